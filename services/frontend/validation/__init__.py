"""What a client may ask for, checked before anything is dispatched: sampling fields into
validated ``SamplingParams`` (``params``) within the model's limits (``limits``) and
defaults (``generation_config``), every structured-output form as one grammar
(``structured_output``), and prompt logprobs (``prompt_logprobs``). Bad input is an
INVALID_ARGUMENT naming its field.
"""
