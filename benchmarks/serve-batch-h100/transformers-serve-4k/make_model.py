"""A random-weight llama3-8b-shaped checkpoint with the word-level tokenizer `bench serve` uses, saved
for `transformers serve` (and `kvpot bench serve --model`): the same model and prompts for both."""
import sys

import torch

from kvpot.bench.serve_workload import word_tokenizer
from kvpot.models.shapes import build

def main():
    out = sys.argv[1]
    model = build("llama3-8b", device="cuda", dtype=torch.bfloat16, seed=0)
    config = model.config
    tok = word_tokenizer(config.vocab_size, config.bos_token_id, config.eos_token_id if isinstance(config.eos_token_id, int) else None)
    # message contents verbatim, so both servers read the same tokens (kvpot without a template does the same)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model.generation_config.eos_token_id = None
    model.save_pretrained(out, max_shard_size="20GB")
    tok.save_pretrained(out)
    print("saved", out, config.eos_token_id)


if __name__ == "__main__":
    main()
