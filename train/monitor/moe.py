"""Mixture-of-experts metrics for a log window: router losses, tokens per expert per layer, load imbalance.

- `moe_aux_loss`, `moe_z_loss`: megatron-core's router puts each micro-batch's load-balancing loss and z-loss
  (unscaled by their coefficients) in its layer-wise tracker (moe_utils.save_to_aux_losses_tracker); they
  are summed over the window's micro-batches and all ranks, divided by the micro-batches counted, averaged
  over layers, and the tracker is cleared (megatron's own `track_moe_metrics` reduces with ReduceOp.AVG,
  which gloo lacks). Present when the loss is on (load_balancing aux_loss / seq_aux_loss; z_loss_coeff > 0).
- `moe_tokens_per_expert`: [layer][expert] tokens routed over the window, all ranks (a forward hook on
  every router while training; under full activation recompute the recomputed forward counts again).
- `moe_load_imbalance_max` / `_mean`: max/mean tokens of the experts of a layer (1.0 = perfectly even),
  the worst layer and the mean over layers; `moe_dropped_share`: the share of the window's token-to-expert
  assignments dropped by the capacity factor (0 without one); `moe_idle_experts`: (layer, expert) pairs
  that got no token in the window; `moe_idle_steps_max`: the most steps in a row (counted in whole log
  windows) any expert has gone without a token (the `alerts.moe_idle_expert_steps` warning).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

AUX_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


class MoEStats:
    """Hooks on every router of `chunks`; `collect()` (every rank, a collective) gives the window's metrics."""

    def __init__(self, chunks: list, moe, num_layers: int, device: torch.device):
        self.moe, self.num_layers, self.device = moe, num_layers, device
        E = moe.num_experts
        self.counts = torch.zeros(num_layers, E, dtype=torch.float64)  # tokens received per (layer, expert)
        self.assigned = torch.zeros(num_layers, dtype=torch.float64)   # tokens × top_k per layer (before drops)
        self.micro = torch.zeros(num_layers, dtype=torch.float64)      # router calls (micro-batches) per layer
        self.idle_steps = torch.zeros(num_layers, E, dtype=torch.int64)  # steps in a row without a token
        # the tracker names megatron's router saves under (only for a loss that is on)
        self.losses = ([AUX_NAMES[moe.load_balancing]] if moe.load_balancing in AUX_NAMES and moe.aux_loss_coeff > 0
                       else []) + (["z_loss"] if moe.z_loss_coeff > 0 else [])
        self._handles = []
        from megatron.core.transformer.moe.router import TopKRouter

        for chunk in chunks:
            for mod in chunk.modules():
                if isinstance(mod, TopKRouter):
                    self._handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, module, inputs, output) -> None:
        if not (module.training and torch.is_grad_enabled()) or module.layer_number is None:
            return
        _, routing_map = output
        i = module.layer_number - 1
        with torch.no_grad():
            self.counts[i] += routing_map.sum(dim=0).to(torch.float64).cpu()
        self.assigned[i] += routing_map.shape[0] * self.moe.top_k
        self.micro[i] += 1

    def collect(self, steps: int = 1) -> dict:
        """The metrics of a window of `steps` steps (the same on every rank); counters and megatron's tracker
        reset."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        L = self.num_layers
        losses = [tracker[n]["values"].detach().to("cpu", torch.float64) if n in tracker else
                  torch.zeros(L, dtype=torch.float64) for n in self.losses]
        flat = torch.cat([self.counts.reshape(-1), self.assigned, self.micro, *losses]).to(self.device)
        dist.all_reduce(flat)  # TP 1 with MoE (train.model.moe.layout_problem): every rank routes its own tokens
        flat = flat.cpu()
        E = self.moe.num_experts
        counts = flat[:L * E].reshape(L, E)
        assigned, micro = flat[L * E:L * E + L], flat[L * E + L:L * E + 2 * L]
        clear_aux_losses_tracker()
        self.counts.zero_(), self.assigned.zero_(), self.micro.zero_()
        layers = micro > 0
        if not bool(layers.any()):
            return {}
        out = {}
        for k, name in enumerate(self.losses):
            v = flat[L * E + 2 * L + k * L:L * E + 2 * L + (k + 1) * L]
            per_layer = v[layers] / micro[layers]
            out["moe_z_loss" if name == "z_loss" else "moe_aux_loss"] = float(per_layer.mean())
        idle = counts == 0
        self.idle_steps = torch.where(idle, self.idle_steps + steps, 0) * layers[:, None]
        c = counts[layers]
        mean = c.mean(dim=1).clamp_min(1e-12)
        imbalance = c.max(dim=1).values / mean
        out.update(moe_load_imbalance_max=float(imbalance.max()), moe_load_imbalance_mean=float(imbalance.mean()),
                   moe_dropped_share=float(1 - c.sum() / assigned[layers].sum().clamp_min(1)),
                   moe_idle_experts=int((c == 0).sum()), moe_idle_steps_max=int(self.idle_steps.max()),
                   moe_tokens_per_expert=[[int(x) for x in row] for row in c.tolist()])
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
