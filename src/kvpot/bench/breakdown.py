"""`kvpot bench decode --breakdown`: where a decoding step's time goes, part by part.

A few fixed-shape steps run uncaptured (`decode="static"`: the same kernels a graph replays, launched one
by one) under `torch.profiler`. `Decoder._static_step` marks its parts with `record_function` scopes
(`STEP_SCOPES`); each kernel is charged to the scope that launched it, and the decoder's kernels are
split by name into the weights' matrix products, kvpot's attention and everything else around them
(norms, activations, residual adds, RoPE tables, cache writes). Per step: kernel milliseconds and
launches per part. Set beside the captured step's time, the sum says how much of a step is kernels and
how much is the GPU waiting between them.

On a CPU there are no kernels: each part is charged the host time of the operators it ran.
"""

from __future__ import annotations

import re

#: record_function names in `kvpot.engine.decoding.Decoder._static_step` -> part
STEP_SCOPES = {
    "kvpot.step.decoder": "decoder",
    "kvpot.step.head": "head (logits)",
    "kvpot.step.method": "method (append / evict)",
    "kvpot.step.sample": "sampling",
}
DECODER_PARTS = ("decoder: weights (matmul)", "decoder: attention", "decoder: other (norms, RoPE, residual, "
                 "cache writes)")
PARTS = (*DECODER_PARTS, *list(STEP_SCOPES.values())[1:], "outside the step")
_MATMUL = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitk|matmul|sm\d+_", re.IGNORECASE)
_ATTENTION = re.compile(r"_decode_kernel|_probs_kernel|_columns_kernel|_row_lse_kernel|hip|infllm|sparse_attn|"
                        r"attention|flash|sdpa|fmha", re.IGNORECASE)


def decoder_part(kernel_name: str) -> str:
    """Which of the decoder's parts a kernel (by its name) belongs to."""
    if _ATTENTION.search(kernel_name):
        return DECODER_PARTS[1]
    if _MATMUL.search(kernel_name):
        return DECODER_PARTS[0]
    return DECODER_PARTS[2]


def _scope(event) -> str | None:
    """The step part whose `record_function` scope encloses the host operator `event`."""
    node = event
    while node is not None:
        if node.name in STEP_SCOPES:
            return STEP_SCOPES[node.name]
        node = node.cpu_parent
    return None


def classify(events, steps: int, cuda: bool) -> dict:
    """Milliseconds and launches per step, by part, from a profiler's `events()`.

    CUDA: every kernel once, charged through the host operator that launched it. CPU: each operator's
    own host time (`self_cpu_time_total`), charged to its enclosing scope."""
    totals = {part: [0.0, 0] for part in PARTS}  # part -> [microseconds, launches]
    for event in events:
        if getattr(event, "device_type", None) is not None and str(event.device_type).endswith("CUDA"):
            continue  # kernels are read through their launching operator's `kernels`
        if event.name in STEP_SCOPES:
            continue  # the scope itself: its operators are counted one by one
        scope = _scope(event)
        if cuda:
            for kernel in getattr(event, "kernels", []) or []:
                part = decoder_part(kernel.name) if scope == "decoder" else (scope or PARTS[-1])
                totals[part][0] += kernel.duration
                totals[part][1] += 1
        elif not cuda and event.self_cpu_time_total > 0:
            part = DECODER_PARTS[2] if scope == "decoder" else (scope or PARTS[-1])
            totals[part][0] += event.self_cpu_time_total
            totals[part][1] += 1
    per_step = max(steps, 1)
    parts = {part: {"ms_per_step": us / 1000 / per_step, "launches_per_step": n / per_step}
             for part, (us, n) in totals.items() if n}
    inside = [v for k, v in parts.items() if k != PARTS[-1]]
    return {
        "steps": steps,
        "timeline": "kernels (GPU)" if cuda else "host operators (CPU: no kernels)",
        "parts": parts,
        "step_ms": sum(v["ms_per_step"] for v in inside),
        "step_launches": sum(v["launches_per_step"] for v in inside),
    }


def step_breakdown(engine, state, steps: int = 8) -> dict:
    """Profile `steps` uncaptured fixed-shape steps decoded from a copy of `state`; `classify`'s result. The steps are
    the one-sequence runner's (`runner="sequence"`), whose parts are profiler scopes (`kvpot.engine.sequence`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    previous, engine.decode = engine.decode, "static"
    runner, engine.runner = engine.runner, "sequence"
    try:
        # one step first, unprofiled: the first fixed-shape step sizes buffers and tables
        engine.generate_ids(state=state, max_new_tokens=2, ignore_eos=True)
        if cuda:
            torch.cuda.synchronize(engine.device)
        with profile(activities=activities) as prof:
            result = engine.generate_ids(state=state, max_new_tokens=steps + 1, ignore_eos=True)
            if cuda:
                torch.cuda.synchronize(engine.device)
    finally:
        engine.decode, engine.runner = previous, runner
    taken = result.stats.decode.get("static_steps", 0) if result.stats.decode else 0
    return classify(prof.events(), taken, cuda)


def breakdown_rows(results: dict) -> tuple[list[str], list[list[str]]] | None:
    """(headers, rows): one column per profiled (method, length), one row per part, ms (launches) per step,
    then the parts' sum against the row's measured (captured) step time."""
    profiled = [r for r in results["rows"] if r.get("breakdown")]
    if not profiled:
        return None
    headers = ["part, per step"] + [f"{r['method']} @ {r['length']:,}" for r in profiled]
    rows = []
    for part in PARTS:
        cells = [r["breakdown"]["parts"].get(part) for r in profiled]
        if any(cells):
            rows.append([part] + [f"{c['ms_per_step']:.2f} ms ({c['launches_per_step']:.0f})" if c else "-"
                                  for c in cells])
    rows.append(["sum of the step's parts"] + [f"{r['breakdown']['step_ms']:.2f} ms "
                                               f"({r['breakdown']['step_launches']:.0f})" for r in profiled])
    rows.append(["measured step (median)"] + [f"{r['ms_per_token']:.2f} ms" if r.get("ms_per_token") else "-"
                                              for r in profiled])
    return headers, rows


def breakdown_markdown(results: dict) -> str | None:
    from kvpot.reporting import markdown_table

    table = breakdown_rows(results)
    if table is None:
        return None
    timeline = results["rows"][0].get("breakdown", {}).get("timeline", "")
    return "\n".join([
        "## Where a step's time goes (`--breakdown`)", "",
        f"Uncaptured fixed-shape steps under torch.profiler, {timeline}: milliseconds (launches) per step by "
        "part. A graph replays the same kernels without launching each: the measured step minus the sum is "
        "the time the GPU waits between kernels.", "",
        markdown_table(*table), ""])
