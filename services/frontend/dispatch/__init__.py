"""The request lifecycle below the serving classes. ``tokenizer_manager.TokenizerManager``
makes the cluster-wide rids, records each in-flight one (``request_state``), sends it to a
scheduler replica it holds a lease on (``router``; a session's requests stay on its own,
``sessions``; one moment's requests go out together, ``add_request_batcher``), routes the
detokenizer's rows back to their waiters and aborts what ends early. ``batch_tokenizer``
turns concurrent encodes into one tokenizer call.
"""
