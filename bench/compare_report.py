"""The printed report of bench/compare.py: one table per dtype, the ratios and the issue's targets, scaling.

Imported by bench/compare.py (same folder); not part of the ``sft`` package.
"""
from __future__ import annotations

import statistics
import tempfile
import time


def summarise(r: dict, peak: float) -> dict:
    """One result's table figures: real tokens/s, padding, median step, memory, MFU (module docstring)."""
    rate = r["real"] / r["seconds"]
    head = r.get("head_flops_per_token", 0)
    flops = ((r["flops_per_token"] - head) * r["real"] + head * r["supervised"]) / r["seconds"]
    return {"rate": rate, "pad": 1 - r["real"] / max(1, r["total"]), "median": r["median_step_s"],
            "mem": r["peak_mem_gib"], "mfu": flops / peak, "cb": r.get("callback_tokens_per_s", rate),
            "batch": r["batch"], "attn": r.get("attn", "?"), "real": r["real"], "steps": r["steps"]}


TARGETS = (("qwen-style", 512, 1.6), ("qwen-style", 2048, 3.0), ("trl-best", None, 1.3), ("llamafactory", None, 1.3))


def paired_verdict(mine: list[float], theirs: list[float]) -> tuple[str, list[float]]:
    """Which of two systems is faster, from their real tokens/s in the same interleaved rounds.

    Round ``i`` of both ran back to back, so a load that comes and goes touches the pair alike: the comparison is
    paired, round by round. One is faster only when it is faster in *every* round both completed (with ``n``
    rounds, the chance that noise alone orders all ``n`` pairs one way is 2 / 2**n: 0.25 with 3 rounds, 0.0625
    with 5, the two-sided sign test); otherwise they are level. A round where either failed (rate 0) is left out.

    Args:
        mine, theirs: real tokens/s per round, same length, in round order.

    Returns:
        ``(verdict, ratios)``: verdict ``"faster"`` (``mine`` won every round), ``"slower"`` (lost every round),
        ``"level"``, or ``"one round"`` (fewer than 2 rounds both completed: noise not measured, no verdict);
        ratios ``mine / theirs`` per completed round.
    """
    ratios = [m / t for m, t in zip(mine, theirs) if m > 0 and t > 0]
    if len(ratios) < 2:
        return "one round", ratios
    if all(x > 1 for x in ratios):
        return "faster", ratios
    if all(x < 1 for x in ratios):
        return "slower", ratios
    return "level", ratios


def fastest_of_ours(rates: dict[str, list[float]]) -> tuple[list[str], list[str]]:
    """Our systems that no other of ours beats in every round (:func:`paired_verdict`) at one length.

    Args:
        rates: ``{system: real tokens/s per round}`` for our systems (names starting with ``ours``).

    Returns:
        ``(unbeaten, lines)``: the unbeaten systems, best round first, and one printable line per pair with the
        default (``ours``). With a single round the unbeaten system is the one with the best rate, as before.
    """
    names = sorted(rates, key=lambda n: -max(rates[n]))
    beaten = {b for a in names for b in names if a != b and paired_verdict(rates[a], rates[b])[0] == "faster"}
    unbeaten = [n for n in names if n not in beaten] or names[:1]
    if len(next(iter(rates.values()), [])) < 2:
        unbeaten = names[:1]
    lines = []
    for other in names:
        if other != "ours" and "ours" in rates:
            verdict, ratios = paired_verdict(rates["ours"], rates[other])
            lines.append(f"ours / {other} round by round: {', '.join(f'{x:.3f}x' for x in ratios)}: "
                         + {"faster": "ours faster in every round", "slower": f"{other} faster in every round",
                            "level": "level (neither faster in every round)",
                            "one round": "one round, noise not measured (--rounds 3 or more for a verdict)"}[verdict])
    return unbeaten, lines


def print_table(a, dtype: str, results: dict, peaks: dict, rounds: dict | None = None) -> None:
    """One dtype's table: every system at every length, then the ratios and targets the issue names.

    ``results``: ``{(dtype, length, system): result}`` (each system's best round); ``rounds``: ``{(dtype, length,
    system): [real tokens/s per round]}``, for the paired verdict on which of ours is fastest
    (:func:`fastest_of_ours`; without it, the best rounds alone decide)."""
    peak = peaks[dtype]
    mem_kind = "CUDA max alloc" if a.cuda else "peak RSS"
    print(f"\n== {dtype} (MFU against the measured {dtype} matmul peak, {peak / 1e9:.1f} GFLOP/s) ==")
    print(f"{'system':<18}{'length':>7}{'micro batch':>12}{'timed steps':>12}{'real tokens':>12}{'real tok/s':>12}"
          f"{'padding':>9}{'median step':>13}"
          f"{mem_kind + ' GiB':>20}{'MFU':>8}{'callback tok/s':>16}  attention")
    got = {}
    for length in a.max_lengths:
        for name in a.systems:
            r = results.get((dtype, length, name))
            if not r:
                print(f"{name:<18}{length:>7}  failed: {a.failures.get(name, 'see stderr')}")
                continue
            v = got[(length, name)] = summarise(r[0], peak)
            print(f"{name:<18}{length:>7}{v['batch']:>12d}{v['steps']:>12d}{v['real']:>12d}{v['rate']:>12.1f}"
                  f"{v['pad']:>9.3f}{v['median']:>11.2f} s"
                  f"{v['mem']:>20.2f}{100 * v['mfu']:>7.1f}%{v['cb']:>16.1f}  {v['attn']}")
    print(f"ratios ({dtype}; real tokens/s of ours default over the other):")
    for length in a.max_lengths:
        ours = got.get((length, "ours"))
        if not ours:
            continue
        parts = [f"ours / {n} {ours['rate'] / got[(length, n)]['rate']:.2f}x" for n in a.systems
                 if n != "ours" and (length, n) in got]
        print(f"  {length}: " + "; ".join(parts))
        mine = {n: (rounds or {}).get((dtype, length, n)) or [got[(length, n)]["rate"]]
                for n in a.systems if (length, n) in got and n.startswith("ours")}
        unbeaten, lines = fastest_of_ours(mine)
        for line in lines:
            print(f"  {length}: {line}")
        best = unbeaten[0] + (f", level with {', '.join(unbeaten[1:])}" if len(unbeaten) > 1 else "")
        print(f"  {length}: fastest of ours: {best}; the default {'is' if 'ours' in unbeaten else 'is NOT'} "
              f"the fastest or level with it; ours MFU {100 * ours['mfu']:.1f}%; peak RSS ours {ours['mem']:.2f}"
              + "".join(f", {n} {got[(length, n)]['mem']:.2f}" for n in ("trl", "trl-best") if (length, n) in got)
              + " GiB")
    print(f"targets ({dtype}):")
    for other, length, want in TARGETS:
        for ln in ([length] if length else a.max_lengths):
            if (ln, "ours") in got and (ln, other) in got:
                x = got[(ln, "ours")]["rate"] / got[(ln, other)]["rate"]
                print(f"  ours / {other} at {ln} >= {want}x: {x:.2f}x {'met' if x >= want else 'MISSED'}")
    for ln in a.max_lengths:
        if (ln, "ours") in got:
            m = got[(ln, "ours")]["mfu"]
            print(f"  ours MFU at {ln} >= 60%: {100 * m:.1f}% {'met' if m >= 0.6 else 'MISSED'}")
            for n in ("trl", "trl-best"):
                if (ln, n) in got:
                    mine, theirs = got[(ln, "ours")]["mem"], got[(ln, n)]["mem"]
                    print(f"  ours peak RSS at {ln} <= {n}'s: {mine:.2f} vs {theirs:.2f} GiB "
                          f"{'met' if mine <= theirs else 'MISSED'}")
    for (ln, name), v in got.items():
        agree = abs(v["cb"] / v["rate"] - 1)
        if agree > 0.10:
            print(f"note: {name} at {ln}: the callback's tokens/s differs from the step timer's by {100 * agree:.1f}%")
    for ln in a.max_lengths:
        r = results.get((dtype, ln, "trl"))
        if r and r[0].get("trl_same_tokens_and_mask"):
            print(f"TRL tokens and assistant mask identical to ours on {r[0]['trl_same_tokens_and_mask']} "
                  f"conversations at length {ln}")


def print_scaling(a, one: list[dict], two: list[dict]) -> None:
    if not one or not two:
        print("scaling: a run failed; see stderr")
        return
    p1 = one[0]["real"] / one[0]["seconds"]
    p2 = [r["real"] / r["seconds"] for r in two]
    eff = statistics.mean(p2) / p1
    print(f"\nscaling ({one[0]['threads']} torch thread(s) per process, torchrun --standalone, "
          f"{'nccl' if a.cuda else 'gloo'}):")
    print(f"  1 process : {p1:8.1f} real tokens/s per process")
    print(f"  2 processes: {' / '.join(f'{x:.1f}' for x in p2)} real tokens/s per process "
          f"(total {sum(p2):.1f}); per-process efficiency {100 * eff:.1f}%")


def preprocessing(a) -> list[tuple[str, float]]:
    """Conversations/s: our rendering + masking vs. rendering + one plain batched tokenizer() call; our full
    dataset preparation (stream, validate, Arrow shard) with 1 and 2 worker processes."""
    from sft.data.records.records import load_conversations
    from sft.data.spec import PreparationSpec
    from sft.data.store.dataset import build_dataset
    from sft.data.template.chat import encode_conversations
    from sft.model.loading import load_tokenizer

    tok, eot, _ = load_tokenizer(a.model)
    convs = load_conversations(a.data, "error")
    msgs = [c.messages for c in convs]
    out = []
    t0 = time.perf_counter()
    encode_conversations(tok, msgs, eot)
    out.append(("ours: render + ids + labels (one batched call)", len(msgs) / (time.perf_counter() - t0)))
    t0 = time.perf_counter()
    texts = [tok.apply_chat_template(m, tokenize=False) for m in msgs]
    t1 = time.perf_counter()
    tok(texts, add_special_tokens=False)
    t2 = time.perf_counter()
    out.append(("plain: render + batched tokenizer(), no labels", len(msgs) / (t2 - t0)))
    out.append(("plain: batched tokenizer() on rendered texts only", len(msgs) / (t2 - t1)))
    for num_proc in (1, 2):
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            build_dataset([a.data], tok, eot, PreparationSpec(a.max_length, cache_dir=cache,
                                                              num_proc=num_proc if num_proc > 1 else None))
            out.append((f"ours: full dataset preparation (stream + Arrow shard, {num_proc} process(es))",
                        len(msgs) / (time.perf_counter() - t0)))
    return out
