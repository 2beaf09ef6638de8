"""Scratch 2: does repeating KV heads let SDPA take a fused kernel for a lower-right causal chunk?"""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

def t(fn, reps=8):
    for _ in range(2): fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return round(sorted(a.elapsed_time(b) for a, b in ev)[reps // 2], 3)

def main():
    torch.manual_seed(0)
    q_len = 2048
    for n in (32768 + q_len, 131072 + q_len):
        q = torch.randn(1, 32, q_len, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        mask = causal_lower_right(q_len, n)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        rows = {"gqa_lower_right": t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)),
                "repeat_cost": t(lambda: (k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)))}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("eff", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            for label, kw in (("lower_right", dict(attn_mask=mask)), ("is_causal", dict(is_causal=True))):
                try:
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(q, kr, vr, **kw)
                        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        rows[f"rep_{name}_{label}"] = (t(lambda: F.scaled_dot_product_attention(q, kr, vr, **kw)), f"{err:.1e}")
                except Exception as e:
                    rows[f"rep_{name}_{label}"] = "ERR " + str(e)[:60]
        print(n, rows, flush=True)


if __name__ == "__main__":
    main()
