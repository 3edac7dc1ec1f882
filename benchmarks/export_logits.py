"""An `sft-train` HF export loaded by transformers agrees with cp_models on the same weights, per document.

    python benchmarks/export_logits.py --export outputs/run/hf --doc-lens 1000 3000 500 --out DIR

The reference is transformers in float32 on the GPU. Against it, per document, ||logits - reference|| /
||reference|| of: ours in float32 (the same function: rounding only), transformers in bf16 and ours in bf16 (what
bf16 costs each), and ours bf16 against transformers bf16. transformers uses its best installed kernels; ours the
kernels sft-train uses. Ours runs the documents packed into one row; transformers runs each document alone (its
GDN / Mamba fallbacks do not keep packed documents apart). Writes ``export_logits.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def load(which: str, path: Path, dtype: torch.dtype):
    if which == "transformers":
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    from cp_models import NemotronHForCausalLM, Qwen35ForCausalLM

    model_type = json.loads((path / "config.json").read_text())["model_type"]
    cls = NemotronHForCausalLM if model_type == "nemotron_h" else Qwen35ForCausalLM
    return cls.from_pretrained(path, dtype=dtype).cuda().eval()


@torch.no_grad()
def logits(which: str, model, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-document fp32 logits: ours over the packed row, transformers one document at a time."""
    if which == "transformers":
        return [model(input_ids=d[None]).logits[0].float() for d in docs]
    packed = model(torch.cat(docs), [d.numel() for d in docs], return_logits=True).logits.float()
    return list(packed.split([d.numel() for d in docs]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--doc-lens", type=int, nargs="+", default=[600, 1500, 300])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import transformers

    torch.manual_seed(0)
    vocab = json.loads((args.export / "config.json").read_text())["vocab_size"]
    docs = [torch.randint(0, min(vocab, 600), (n,), device="cuda") for n in args.doc_lens]
    runs = {}
    for which, dtype in (("transformers", torch.float32), ("ours", torch.float32), ("transformers", torch.bfloat16),
                         ("ours", torch.bfloat16)):  # fmt: skip
        model = load(which, args.export, dtype)
        runs[f"{which} {str(dtype).split('.')[-1]}"] = logits(which, model, docs)
        del model
        torch.cuda.empty_cache()

    def rel(got: str, ref: str) -> list[float]:
        return [((g - r).norm() / r.norm()).item() for g, r in zip(runs[got], runs[ref], strict=True)]

    columns = {name: rel(name, "transformers float32") for name in list(runs)[1:]}
    columns["ours bf16 vs transformers bf16"] = rel("ours bfloat16", "transformers bfloat16")
    rows = [{"tokens": d.numel(), **{k: v[i] for k, v in columns.items()}} for i, d in enumerate(docs)]
    for row in rows:
        print(row)
    args.out.mkdir(parents=True, exist_ok=True)
    what = (
        "||logits - reference|| / ||reference|| per document; reference: transformers in float32 on the GPU, "
        "each document alone; ours runs the documents packed into one row."
    )
    result = {"export": str(args.export), "transformers": transformers.__version__, "what": what, "documents": rows}
    (args.out / "export_logits.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
