"""A tiny mixture of experts (Qwen3-MoE, or ``--family mixtral`` / ``olmoe``: 4 experts, top 2, its router's
load-balancing loss on at 0.1; ``own``: a model of one's own with an ``ep_plan``) trained 3 SGD steps on the padded
rows of tests/jobs/chunked.py on every process of the launch, ``--ep`` its ep_size, gradients clipped to 0.5 (it binds
at every step). Rank 0 writes the losses, the experts' load, an evaluation, a prediction, the mesh of the experts'
weights and the banner to ``<out>/experts.json``, and fit() the weights to ``<out>/final``.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 4 tests/jobs/experts.py \\
        --out runs/ep --ep 2 --batch-size 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from chunked import VOCAB, rows  # noqa: E402

from trainer import TrainConfig, Trainer  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1, max_position_embeddings=64)


class OwnExperts(torch.nn.Module):
    """A user's experts, called as transformers calls its own: each token's top-k experts and their weights."""

    def __init__(self, experts: int, width: int, inner: int):
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(experts, inner, width) * 0.2)
        self.w_out = torch.nn.Parameter(torch.randn(experts, width, inner) * 0.2)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        # Under expert parallelism its weights hold this process's experts, the ids local to them.
        for expert in range(self.w_in.shape[0]):
            token, slot = torch.where(top_k_index == expert)
            inner = torch.nn.functional.silu(hidden[token] @ self.w_in[expert].T)
            out = out.index_add(0, token, (inner @ self.w_out[expert].T) * top_k_weights[token, slot, None])
        return out


class OwnMoE(torch.nn.Module):
    """A model of one's own with one MoE layer and an ``ep_plan`` in transformers' words; its loss over every next
    token (the same count on every row)."""

    def __init__(self):
        super().__init__()
        self.embed, self.router = torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, 4, bias=False)
        self.experts, self.head = OwnExperts(4, 32, 16), torch.nn.Linear(32, VOCAB)
        self.ep_plan = {
            "experts": "ep_dispatch_experts",
            "experts.w_in": "grouped_gemm",
            "experts.w_out": "grouped_gemm",
        }

    def forward(self, input_ids, labels=None, attention_mask=None):
        hidden = self.embed(input_ids)
        flat = hidden.reshape(-1, 32)
        weights, chosen = torch.topk(torch.softmax(self.router(flat), dim=-1), 2)
        logits = self.head(hidden + self.experts(flat, chosen, weights).view_as(hidden))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


def build(family: str = "qwen3_moe") -> torch.nn.Module:
    """The family's tiny MoE, the same weights on every process (seed 0)."""
    import transformers

    torch.manual_seed(0)
    if family == "own":
        return OwnMoE()
    if family == "mixtral":
        config = transformers.MixtralConfig(**SIZES, **MOE, intermediate_size=16, num_local_experts=4)
        return transformers.MixtralForCausalLM(config)
    if family == "olmoe":
        config = transformers.OlmoeConfig(**SIZES, **MOE, intermediate_size=16, num_experts=4)
        return transformers.OlmoeForCausalLM(config)
    config = transformers.Qwen3MoeConfig(
        **SIZES, **MOE, head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=4, norm_topk_prob=True
    )
    return transformers.Qwen3MoeForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral", "olmoe", "own"])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-every", type=int, default=None)
    args = parser.parse_args()
    config = TrainConfig(
        output_dir=args.out,
        batch_size=args.batch_size,
        max_steps=args.steps,
        lr=0.5,
        optimizer="sgd",
        log_every=1,
        shuffle=False,
        save_every=args.save_every,
        resume=args.resume,
        ep_size=args.ep,
        # Binds at every step: the gradients' norm over both meshes (the experts' and the rest's) is exact too.
        max_grad_norm=0.5,
    )
    data = rows()
    trainer = Trainer(build(args.family), config, train_data=data, eval_data=data[:8])
    trainer.fit()
    evaluation = trainer.evaluate()
    logits = trainer.predict(data[:6], predict_fn=lambda model, batch: model(**batch)["logits"][:, :, :4])
    weight = next(next(m for name, m in trainer.model.named_modules() if name.endswith("experts")).parameters())
    if trainer.accelerator.is_main_process:
        found = {
            "logits": logits.tolist(),
            "expert_mesh": list(weight.device_mesh.mesh_dim_names) if hasattr(weight, "device_mesh") else None,
            "losses": [row["train_loss"] for row in trainer.log_history if "train_loss" in row],
            "load": [row.get("expert_load") for row in trainer.log_history if "train_loss" in row],
            "eval_loss": evaluation["eval_loss"],
            "banner": trainer.describe(),
        }
        Path(args.out, "experts.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
