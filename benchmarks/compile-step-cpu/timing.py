"""Compile time of the fixed-shape step on CPU: whole decoder vs regional (shared / per layer).
Cold inductor cache per run; C++ compiled in-process so CPU seconds count it (os.times children too)."""
import os, sys, tempfile, time, json
if __name__ == "__main__":  # before torch is imported; an import alone (tests) leaves the environment alone
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))  # conftest
import torch
from torch._dynamo.utils import counters
from conftest import build, VOCAB
import kvpot
import kvpot.engine.regions as regions

def main():
    variant, depth = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    model = build("llama3", num_hidden_layers=depth)
    torch.manual_seed(1)
    ctx, q = torch.randint(3, VOCAB, (160,)), torch.randint(3, VOCAB, (6,))
    method = lambda: kvpot.StreamingLLM(sinks=4, window=188, chunk_size=32)
    NEW = 12
    def cpu():
        t = os.times(); return t.user + t.system + t.children_user + t.children_system
    def run(engine):
        t, c = time.perf_counter(), cpu()
        out = engine.generate_ids(ctx, q, max_new_tokens=NEW, ignore_eos=True)
        return time.perf_counter() - t, cpu() - c, out.token_ids
    for _ in range(2):
        base_t, base_c, base_ids = run(kvpot.Engine(model, method=method(), decode="static"))
    engine = kvpot.Engine(model, method=method(), decode="static", compile_step=True)
    if variant == "whole":  # the previous compile_step: torch.compile of the whole decoder
        whole = torch.compile(engine.decoder, dynamic=True)
        engine.step_decoder = lambda: whole
    elif variant == "per-layer":  # regional, each layer handed the whole cache: one recompilation per layer
        regions._with_view = lambda kwargs, index: kwargs
    t, c, ids = run(engine)
    t2, c2, _ = run(engine)
    times = torch._dynamo.utils.compilation_time_metrics
    phase = {k: round(sum(v), 1) for k, v in times.items() if k in ("_compile.compile_inner", "compile_fx_inner", "OutputGraph.call_user_compiler")}
    print(json.dumps(dict(variant=variant, depth=depth, compile_wall_s=round(t - t2, 1), compile_cpu_s=round(c - c2, 1),
                          same_tokens=ids == base_ids, graphs=counters["stats"]["unique_graphs"],
                          fx_hit=counters["inductor"]["fxgraph_cache_hit"], fx_miss=counters["inductor"]["fxgraph_cache_miss"],
                          phases=phase)))


if __name__ == "__main__":
    main()
