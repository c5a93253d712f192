"""Expert parallelism and the expert group: where an MoE layer's expert stacks live, and how
its tokens reach them.

[Note: expert stacks over the expert mesh] A policy rule with `group="egtp"` marks expert
stacks (`[experts, out, in]`, one parameter per role, as HF transformers 5.x and torchtitan
store them). They live on the expert mesh, a second factorization of the same world as
edp x ep x egtp: each rank keeps the experts of its ep rank (an `EPLayout`, dim 0 split in
ep equal blocks), and GTP shards that block along the rule's dim over egtp, replicating it
over edp, exactly as dense weights are sharded over gtp and replicated over dp. A use gathers
the ep block over egtp: one collective per stack, whichever experts got tokens, so routing
never makes ranks' gathers differ. Gradients are reduce-scattered over egtp and reduced over
edp. With ep > 1 the stack's gradient on its owner already sums the tokens of every ep rank
(they came through the all-to-all), so under a mean reduction it is divided by ep once more:
the mean stays one over every data rank, as for dense weights.

With ep > 1, the experts modules the policy names in `expert_parallel` hold E/ep experts, and
each call sends each token to the rank that holds its expert and back (`ExpertDispatch`): the
router and the combine stay the model's, as with torchtitan's ExpertParallel. Split sizes come
from the routing, so the dispatch reads them on the host: an expert-parallel step cannot be
captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm.comm import Comm
from ..config.plan import ParameterPlan, blocks_on_gathered_weights, module_matches
from ..config.policy import GTPPolicy
from ..errors import WrapError
from ..mesh import GTPMesh


@dataclasses.dataclass(frozen=True)
class EPLayout:
    """An expert stack partitioned over ep: this rank keeps experts [start, start + count)."""

    shape: torch.Size  # the whole stack's
    rank: int
    size: int

    @property
    def count(self) -> int:
        return self.shape[0] // self.size

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole stack."""
        return full.narrow(0, self.rank * self.count, self.count)


def plan_experts(
    module: nn.Module, plans: list[ParameterPlan], policy: GTPPolicy, mesh: GTPMesh
) -> tuple[dict[int, EPLayout], list[nn.Module]]:
    """Check the policy's expert stacks against the expert mesh and return, by parameter id,
    their ep layouts (none without expert parallelism), and the experts modules whose calls
    dispatch tokens over ep. Raises WrapError naming the cause for what cannot run."""
    experts = [p for p in plans if p.expert]
    ep = mesh.ep
    if ep.size == 1:
        return {}, []
    modules = [
        mod
        for fqn, mod in module.named_modules()
        if fqn and any(module_matches(n, fqn, mod) for n in policy.expert_parallel)
    ]
    names = {id(m): fqn for fqn, m in module.named_modules()}
    if not modules:
        raise WrapError(
            f"the expert mesh has an ep dim of {ep.size} ranks, but no module matches the "
            f"policy's expert_parallel {list(policy.expert_parallel)}: name the experts modules "
            "there (their forward takes tokens sorted by expert and tokens per expert), or "
            "give an expert_mesh without ep"
        )
    both = [names[id(m)] for m in modules if m in blocks_on_gathered_weights(module, policy)]
    if both:
        raise WrapError(
            f"'{both[0]}' is in the policy's expert_parallel and gather_per_block: an "
            "expert-parallel module exchanges its tokens around its own forward; run its parent "
            "(the MoE layer) on gathered weights instead"
        )
    layouts = {}
    for plan in experts:
        owner = next((m for m in modules for o, _ in plan.owners if o is m), None)
        if owner is None:
            raise WrapError(
                f"'{plan.fqns[0]}' is an expert stack partitioned over ep, but its module is "
                f"not among the policy's expert_parallel {list(policy.expert_parallel)}: it "
                "would compute with its rank's experts on every expert's tokens. Add its "
                "module there if its forward takes (tokens sorted by expert, tokens per "
                "expert); else leave ep out of the expert_mesh"
            )
        shape = plan.param.shape
        if plan.param.dim() < 2 or shape[0] % ep.size:
            raise WrapError(
                f"expert stack '{plan.fqns[0]}' of shape {tuple(shape)} cannot be split over "
                f"ep={ep.size}: its dim 0 (the experts) must be a multiple of ep; choose an ep "
                "that divides the number of experts"
            )
        layouts[id(plan.param)] = EPLayout(shape, ep.rank, ep.size)
    for mod in modules:
        owned = [p for p in plans if p.expert and any(o is mod for o, _ in p.owners)]
        if not owned or len(owned) != len(list(mod.parameters(recurse=False))):
            raise WrapError(
                f"expert_parallel module '{names[id(mod)]}' must hold expert stacks only, each "
                "sharded by a rule with group='egtp' (it holds "
                f"{[n for n, _ in mod.named_parameters(recurse=False)]}); give its parameters "
                "such a rule, or leave it out of expert_parallel"
            )
    return layouts, modules


def dispatch_tokens(modules: list[nn.Module], comm: Comm) -> None:
    """Make each experts module's calls send tokens to their experts' ep ranks and back."""
    for mod in modules:
        mod.forward = ExpertDispatch(mod.forward, comm)


class ExpertDispatch:
    """An experts module's forward over ep: tokens sorted by expert, with a count for each of
    the layer's E experts, go to the ranks holding their experts (an all-to-all), are computed
    there by this rank's E/ep experts, and come back in their order (another all-to-all).
    The exchanges go through the engine's Comm, so a peer that failed or left is named
    instead of waited for."""

    def __init__(self, inner: Callable[..., torch.Tensor], comm: Comm) -> None:
        self.inner = inner
        self.comm = comm

    # Eager under torch.compile, experts and all: the exchange reads its sizes on the host and
    # waits through the engine's watch, which Dynamo would break the graph at (warning of the
    # watch's clock), and the experts then see a token count that changes with every routing,
    # which it would guard on, compiling the block again and again. Disabled, the dispatch is
    # one graph break, and the graphs of the first step serve every routing.
    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, counts: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        size = self.comm.mesh.ep.size
        if counts.numel() % size:
            raise WrapError(
                f"an expert-parallel experts module got counts for {counts.numel()} experts, "
                f"not a multiple of ep={size}: pass one count per expert of the whole layer"
            )
        local = counts.numel() // size
        counts = counts.to(torch.long).contiguous()
        received = torch.empty_like(counts)  # [source rank, its count for each local expert]
        self.comm.wait(self.comm.all_to_all(received, counts, None, None, self.comm.mesh.ep,
                                            "all-to-all of the tokens per expert"))  # fmt: skip
        from_each = received.view(size, local)
        sends = counts.view(size, local).sum(1).tolist()
        recvs = from_each.sum(1).tolist()
        tokens = _AllToAll.apply(x, recvs, sends, self.comm)
        # Received by source rank, then expert: sort them by expert for the experts' GEMMs.
        expert_of = torch.arange(local, device=x.device).repeat(size)
        order = torch.argsort(expert_of.repeat_interleave(from_each.flatten()), stable=True)
        out = self.inner(tokens[order], from_each.sum(0), *args, **kwargs)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(out[back], sends, recvs, self.comm)


class _AllToAll(torch.autograd.Function):
    """Rows of `x` in blocks of `sends` to each rank, `recvs` from each; backward reverses it."""

    @staticmethod
    def forward(ctx, x, recvs, sends, comm):  # type: ignore[override]
        ctx.recvs, ctx.sends, ctx.comm = recvs, sends, comm
        return _all_to_all(comm, x, recvs, sends, "all-to-all of the tokens to their experts")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        what = "all-to-all of the tokens' gradients back from their experts"
        return _all_to_all(ctx.comm, grad, ctx.sends, ctx.recvs, what), None, None, None


def _all_to_all(
    comm: Comm, x: torch.Tensor, recvs: list[int], sends: list[int], what: str
) -> torch.Tensor:
    out = x.new_empty((sum(recvs), *x.shape[1:]))
    comm.wait(comm.all_to_all(out, x.contiguous(), recvs, sends, comm.mesh.ep, what))
    return out
