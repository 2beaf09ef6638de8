"""Scratch: chunked-prefill attention paths at llama3-8b layer shape (which SDPA kernel, and is is_causal bottom-right?)."""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

def t(fn, reps=10):
    for _ in range(3): fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]

def main():
    torch.manual_seed(0)
    q_len = 2048
    for n in (8192 + q_len, 32768 + q_len, 131072 + q_len):
        q = torch.randn(1, 32, q_len, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        mask = causal_lower_right(q_len, n)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        rows = {"lower_right_bias": t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))}
        for name, backend in (("is_causal_flash", SDPBackend.FLASH_ATTENTION), ("is_causal_eff", SDPBackend.EFFICIENT_ATTENTION), ("is_causal_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    rows[name] = (t(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)), f"err_vs_lower_right={err:.2e}")
            except Exception as e:
                rows[name] = ("ERR", str(e)[:120])
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                rows["lower_right_bias_flash_forced"] = t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        except Exception as e:
            rows["lower_right_bias_flash_forced"] = ("ERR", str(e)[:120])
        # flash over the whole square (one-shot prefill equivalent, q=n): FLOPs reference
        print(n, rows, flush=True)


if __name__ == "__main__":
    main()
