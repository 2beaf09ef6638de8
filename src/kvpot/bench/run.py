"""`run_bench`: build the shape, run the configured mode, write results.json, summary.md and plots."""

from __future__ import annotations

import sys

from kvpot.bench.attention import bench_attention
from kvpot.bench.backends import sdpa_backends
from kvpot.bench.common import machine
from kvpot.bench.config import BenchConfig
from kvpot.bench.decode import bench_decode
from kvpot.bench.prefill import bench_prefill
from kvpot.bench.throughput import bench_throughput
from kvpot.bench.report import plot_names, rich_table, write_reports


def run_bench(config: BenchConfig, progress: bool = True, show: bool = True, model=None) -> dict:
    """Run the benchmark `config.mode`; write results.json, summary.md and plots; return the results.
    `model`: a model of `config.shape` built already (`shapes.build`), reused across runs (a 70B shape
    split over GPUs takes a while to draw)."""
    import torch

    from kvpot.models import shapes
    from kvpot.methods.spec import MethodSpec, build_methods
    from kvpot.models import resolve_device, resolve_dtype

    runs = build_methods([MethodSpec.parse(m) for m in config.methods], config.budget, config.settings) \
        if config.methods else []
    if config.tp > 1:  # under torchrun: every rank runs the same rows; rank 0 writes OUT, rank r OUT/rank-r
        from kvpot.models.parallel import is_rank_zero, rank

        show = show and is_rank_zero()
        config.out = config.out if is_rank_zero() else config.out / f"rank-{rank()}"
    elif config.device_map is None:
        config.device = resolve_device(config.device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    shape = shapes.get_shape(config.shape)
    model_config = shape.config()
    torch.manual_seed(config.seed)
    if config.mode == "attention":
        dtype = resolve_dtype(config.dtype)
        model = None
    else:
        if model is None:
            model = shapes.build(config.shape, config.device, resolve_dtype(config.dtype), seed=config.seed,
                                 device_map=config.device_map, max_memory=config.max_memory, tp_size=config.tp)
        from kvpot.models.devices import describe_devices, input_device

        config.device, config.model_devices = str(input_device(model)), describe_devices(model)  # ids go in there
        dtype = next(model.parameters()).dtype
    from kvpot.models import default_dtype

    dtype = dtype or default_dtype(config.device)
    results = {
        "mode": config.mode, "command": list(sys.argv), "machine": machine(config.devices),
        "dtype": str(dtype).removeprefix("torch."), "config": config.to_dict(),
        "shape": shapes.describe(shape), "model_config": model_config.to_dict(),
        "methods": {run.label: run.describe() for run in runs}, "complete": False, "rows": [],
    }
    config.out.mkdir(parents=True, exist_ok=True)  # under torchrun, rank r writes OUT/rank-r, maybe before rank 0 made OUT
    with sdpa_backends(config.sdpa, config.device) as enabled:  # every row, warm-ups included
        results["machine"].update(sdpa=config.sdpa, sdpa_backends=enabled)
        if config.mode == "prefill":
            bench_prefill(config, model, runs, results, progress)
        elif config.mode == "decode":
            bench_decode(config, model, runs, results, progress)
        elif config.mode == "throughput":
            bench_throughput(config, model, runs, results, progress)
        else:
            bench_attention(config, model_config, dtype, runs, results, progress)
    results["complete"] = True
    write_reports(results, config.out)
    if show:
        from rich.console import Console

        console = Console(width=max(120, Console().width))
        console.print(rich_table(results))
        from kvpot.bench.breakdown import breakdown_rows
        from kvpot.reporting import rich_table as table_of

        if (parts := breakdown_rows(results)) is not None:
            console.print(table_of("where a decoding step's time goes (uncaptured steps, profiler)", *parts))
        print(f"wrote {config.out}/: results.json, summary.md, " + ", ".join(plot_names(results)))
    return results
