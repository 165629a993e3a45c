"""`MasterOptimizer`: the shared step of every optimizer here, over any master-weight storage.

The FP32/BF16 masters of a parameter group are updated by one fused elementwise launch
(:func:`adahop.kernels.optim_step.optim_step_multi`: the Triton kernel on CUDA, its bit-exact PyTorch
reference elsewhere); packed FP8/FP4 masters one by one, by the same FP32 update followed by a
re-pack (:func:`adahop.optim.master.write_master`). States live in ``state_dtype`` (FP32 or BF16)
and keep it through ``load_state_dict``
(torch's loader would cast them to the parameter's dtype). Under FSDP2 a parameter is a DTensor
and the update runs on its local shard, so the states are sharded exactly like the parameters.
"""

from __future__ import annotations

import math

import torch

from ..kernels.optim_step import STATE_NAMES, MultiTensorStep, optim_step_multi, optim_update, step_scalars
from ..utils import mix_seed
from . import master
from .master import PackedMaster, read_master, write_master

__all__ = ["MasterOptimizer", "STATE_DTYPES"]

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


_TORCH_FLAGS = ("foreach", "fused", "maximize", "amsgrad", "capturable", "differentiable")
_OWN_ATTRS = ("state_dtype", "seed", "backend", "rounding", "algorithm", "form")


def _check_hparams(where: str, h: dict, *, group: bool = False) -> None:
    """Raise ValueError naming ``where`` for a hyper-parameter of ``h`` out of range (those present). A parameter
    ``group`` may sit at lr 0 (a part of the model held still, as torch allows); the constructor's default may not."""
    def bad(key, rule):
        raise ValueError(f"{where}: {key}={h[key]!r} must be {rule}")

    def number(v) -> bool:  # a Python, NumPy or 0-d tensor number (torch takes all three), finite
        if isinstance(v, bool) or (torch.is_tensor(v) and v.numel() != 1):
            return False
        try:
            return math.isfinite(float(v))
        except (TypeError, ValueError):
            return False

    if "lr" in h and not (number(h["lr"]) and (h["lr"] >= 0 if group else h["lr"] > 0)):
        bad("lr", "a finite number >= 0" if group else "a finite number > 0")
    if "betas" in h:
        b = h["betas"]
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(number(x) and 0 <= x < 1 for x in b)):
            bad("betas", "two numbers in [0, 1)")
    if "eps" in h and not (number(h["eps"]) and h["eps"] > 0):
        bad("eps", "a finite number > 0")
    if "weight_decay" in h and not (number(h["weight_decay"]) and h["weight_decay"] >= 0):
        bad("weight_decay", "a finite number >= 0")
    if "mul_lr_scale" in h and not (number(h["mul_lr_scale"]) and h["mul_lr_scale"] >= 0):
        bad("mul_lr_scale", "a finite number >= 0")
    if "tau" in h and not (number(h["tau"]) and h["tau"] > 0):
        bad("tau", "a finite number > 0")
    for key in ("cap", "w_max"):
        if h.get(key) is not None and not (number(h[key]) and h[key] > 0):
            bad(key, "a finite number > 0, or None (off)")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), else ``t``."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class MasterOptimizer(torch.optim.Optimizer):
    """Adam-family optimizer for FP32, BF16 or packed master weights (subclasses pick the rule).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay; the same defaults, 0.01 included).
        state_dtype: ``torch.float32`` or ``torch.bfloat16`` for every state buffer.
        seed: run seed of the stochastic rounding; each step's Philox key mixes it with the step,
            and each parameter draws from its own stream (its index). Under FSDP2 pass a per-rank seed
            (each rank rounds its own shard); under DDP one seed for all ranks, or their replicas drift.
            Two optimizers with one seed draw the same bits for their i-th parameters: give each its own
            (one optimizer per parameter or per submodule), or their rounding errors are correlated.
        backend: ``auto`` (fused Triton kernel on CUDA), ``triton`` or ``reference``.
        rounding: ``nearest`` or ``stochastic`` rounding of the master write.
        **extra: per-group hyper-parameters of the rule (``mul_lr_scale``, ``tau``, ``cap``, ``w_max``).

    Raises:
        ValueError: a bad hyper-parameter (a non-finite ``lr``/``eps``, ``betas`` not two numbers in [0, 1), a
            negative ``weight_decay``), state dtype, rounding or backend; at ``load_state_dict``, states of another
            rule or state dtype, or a torch group with ``maximize``, ``amsgrad`` or L2 decay; at ``step`` (before
            any step is counted), a parameter ``convert_master_weights`` replaced after this was built, a sparse
            gradient, a dtype other than FP32/BF16, a non-contiguous weight.
        TypeError: an option the rule does not read (torch's ``maximize``, ``amsgrad``, ``foreach``, ``fused``, a typo).
    """

    algorithm = "adamw"  # a key of adahop.kernels.optim_step.STATE_NAMES
    rule_options: tuple[str, ...] = ()  # the per-group hyper-parameters of the rule (``**extra``)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 state_dtype: torch.dtype = torch.float32, seed: int = 0, backend: str = "auto",
                 rounding: str = "nearest", **extra):
        name = type(self).__name__
        unknown = sorted(set(extra) - set(self.rule_options))
        if unknown:  # torch.optim.AdamW's maximize/amsgrad/foreach/fused, or a typo: kept in the groups, never read
            raise TypeError(f"{name}: unsupported option(s) {', '.join(unknown)}; it takes lr, betas, eps, weight_decay, "
                            f"state_dtype, seed, backend, rounding{''.join(', ' + o for o in self.rule_options)}")
        _check_hparams(name, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra))
        if state_dtype not in STATE_DTYPES.values():
            raise ValueError(f"state_dtype={state_dtype}; use torch.float32 or torch.bfloat16")
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding={rounding!r}; use 'nearest' or 'stochastic'")
        if backend not in ("auto", "triton", "reference"):
            raise ValueError(f"backend={backend!r}; use auto, triton or reference")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      algorithm=self.algorithm, **extra))
        self.state_dtype, self.seed, self.backend, self.rounding = state_dtype, seed, backend, rounding
        self._stash = None
        self._plans: dict[int, _Plan] = {}  # group index → its kept buckets (step)
        self._register_load_hooks()

    def _register_load_hooks(self) -> None:
        # states of another rule or dtype refused before a load, the saved dtypes restored after it
        self.register_load_state_dict_pre_hook(lambda opt, sd: opt._check_loaded(sd))
        self.register_load_state_dict_post_hook(lambda opt: opt._restore_state_dtypes())

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, with the group's own hyper-parameters (merged over the
        defaults) checked first as the constructor checks its own (the constructor's groups pass here too).

        Raises:
            ValueError: a bad value (as the constructor's). TypeError: an option the rule does not read,
                or one of torch's flags (``foreach``, ``fused``, ...) turned on."""
        if isinstance(param_group, dict):  # checked before torch appends it (a refused group must not stay)
            self._check_group({**self.defaults, **param_group}, len(self.param_groups))
        super().add_param_group(param_group)

    def _check_group(self, group: dict, index: int) -> None:
        where = f"{type(self).__name__} param group {index}"
        known = set(self.defaults) | {"params", "param_names", "name", "initial_lr"}
        unknown = sorted(k for k in group if k not in known and k not in _TORCH_FLAGS)
        flags = sorted(k for k in _TORCH_FLAGS if group.get(k))  # torch's own, False: nothing to read
        if unknown or flags:
            raise TypeError(f"{where}: unsupported option(s) {', '.join(unknown + flags)}; a group takes lr, betas, eps, "
                            f"weight_decay{''.join(', ' + o for o in self.rule_options)}")
        _check_hparams(where, group, group=True)

    def __getstate__(self) -> dict:
        # torch's keeps defaults, state and param groups: a deep copy or pickle lost the storage options
        # (state_dtype, seed, rounding, backend, the M+Adam form) and failed at its first step
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in _OWN_ATTRS if k in self.__dict__}}

    def __setstate__(self, state: dict) -> None:
        # torch's load_state_dict calls this too, on a live optimizer between its pre- and post-hooks: only a
        # new object (unpickled, deep-copied) gets fresh plans and hooks, or the stash the post-hook restores
        # the state dtypes from was dropped (FP32 states came back cast to the BF16 masters' dtype)
        fresh = "_plans" not in self.__dict__
        super().__setstate__(state)
        if fresh:
            self._stash, self._plans = None, {}
            self._register_load_hooks()

    # -- state ------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = 0
            for name in STATE_NAMES[self.algorithm]:
                st[name] = torch.zeros(p.shape, dtype=self.state_dtype, device=p.device) if isinstance(p, PackedMaster) \
                    else torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.contiguous_format)
        return st

    def _check_loaded(self, sd: dict) -> None:
        """Before ``load_state_dict``: refuse states of another rule (AdamW's into Kahan's or M+Adam's, one
        M+Adam form's into another's: the step then failed on a missing buffer, or ran on the wrong one) or of
        another state dtype (FP32 states kept in an optimizer built for BF16 ones); then keep them for
        :meth:`_restore_state_dtypes`."""
        name, want = type(self).__name__, set(STATE_NAMES[self.algorithm])
        saved_rule = {g.get("algorithm") for g in sd["param_groups"]} - {None}
        if saved_rule and saved_rule != {self.algorithm}:
            raise ValueError(f"{name}.load_state_dict: the states are of the {sorted(saved_rule)[0]!r} update rule, this "
                             f"optimizer runs {self.algorithm!r}; load them into the optimizer (and M+Adam form) that saved them")
        for i, g in enumerate(sd["param_groups"]):  # torch's groups: their flags replace ours, and no step reads them
            lacking = [k for k in ("lr", "betas", "eps", "weight_decay", *self.rule_options) if k not in g]
            if lacking:  # e.g. torch's SGD: its groups replace ours, and the first step failed on a bare KeyError
                raise ValueError(f"{name}.load_state_dict: saved param group {i} has no {', '.join(lacking)}: it is "
                                 f"another optimizer's (torch's SGD, or another update rule's); load it into the optimizer that saved it")
            flags = [k for k in ("maximize", "amsgrad") if g.get(k)]
            if g.get("decoupled_weight_decay") is False and g.get("weight_decay", 0):
                flags.append("decoupled_weight_decay=False (torch.optim.Adam's L2 weight decay)")
            if flags:
                raise ValueError(f"{name}.load_state_dict: saved param group {i} has {', '.join(flags)}, which this "
                                 f"optimizer's update does not do (it would continue silently without it); resume with "
                                 f"the torch optimizer that saved them")
        for saved in sd["state"].values():
            have = {k for k, v in saved.items() if torch.is_tensor(v) and k != "step"}
            if have != want:
                raise ValueError(f"{name}.load_state_dict: the saved states {sorted(have)} are not this optimizer's "
                                 f"{sorted(want)}; load them into the optimizer that saved them")
            dtypes = {saved[k].dtype for k in have}
            if dtypes != {self.state_dtype}:
                raise ValueError(f"{name}.load_state_dict: the saved states are {', '.join(map(str, sorted(dtypes, key=str)))}, "
                                 f"this optimizer keeps {self.state_dtype}; build it with state_dtype as saved to resume exactly")
        # the saved groups' parameter keys in order: indices from state_dict(), parameter names from
        # torch.distributed.checkpoint's set_optimizer_state_dict (a sharded checkpoint's resume)
        self._stash = (sd["state"], [k for g in sd["param_groups"] for k in g["params"]])

    def _restore_state_dtypes(self) -> None:
        """After ``load_state_dict``: the states as saved (their own dtype), not cast to the parameter's."""
        stash, self._stash = self._stash, None
        self._plans.clear()  # they hold the old state tensors
        if not stash or not stash[0]:
            return
        saved_states, keys = stash
        by_key = dict(zip(keys, (p for g in self.param_groups for p in g["params"])))  # as torch's load_state_dict maps them
        for key, saved in saved_states.items():
            p = by_key[key]
            for k, v in saved.items():
                if torch.is_tensor(v) and k != "step":
                    self.state[p][k] = v.to(device=self.state[p][k].device).clone()

    def _scalars(self, group: dict, step: int):
        b1, b2 = group["betas"]
        cap, w_max = group.get("cap"), group.get("w_max")
        return step_scalars(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                            step=step, mul_lr=group["lr"] * group.get("mul_lr_scale", 0.0), tau=group.get("tau", 1e-6),
                            cap=math.inf if cap is None else cap, w_max=math.inf if w_max is None else w_max)

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` if given.

        FP32/BF16 masters go to the fused multi-tensor step, one launch per (device, dtypes) bucket
        of a group, normally one per group; stochastic rounding keys Philox with one seed per step
        (``mix_seed(seed, "optim", step)``) and gives each parameter its own stream (its index over
        all groups). Packed masters update one by one. Once every parameter of a group has the same
        step count and a gradient, the group's buckets are kept (:class:`_Plan`) and a step only
        reads the gradients and launches."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        base = 0
        for gi, group in enumerate(self.param_groups):  # refusals before any group steps: none is left a step ahead
            if gi not in self._plans:
                self._check_params(group, base)
            base += len(group["params"])
        base = 0
        for gi, group in enumerate(self.param_groups):
            plan = self._plans.get(gi)
            if plan is None or not plan.step(self, group, base):
                if plan is not None:  # a kept plan stopped fitting: the group was not checked above
                    self._check_params(group, base)
                self._plans.pop(gi, None)
                self._general_step(group, base)
                self._plans[gi] = _Plan.build(self, group, base)
            base += len(group["params"])
        return loss

    def _check_params(self, group: dict, base: int) -> None:
        """Refuse, before any state is created or any step counted, a parameter the step cannot update: one
        replaced by ``convert_master_weights``, a sparse gradient, a dtype other than FP32/BF16 (complex, FP16,
        FP64), a non-contiguous weight. A refusal after its step count had moved left it one ahead: the first
        update after the fix ran with the next step's bias correction."""
        name = type(self).__name__
        for index, p in enumerate(group["params"], base):
            if getattr(p, "_adahop_replaced", None):
                raise ValueError(f"{name}: parameter {index} was replaced by convert_master_weights(..., "
                                 f"{p._adahop_replaced!r}) after this optimizer was built, so the model's packed weight "
                                 "would never train; build the optimizer after convert_master_weights")
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(f"{name}: parameter {index} has a sparse gradient (an Embedding(sparse=True)?), "
                                 "which the fused step does not take; use a dense one (sparse=False)")
            if isinstance(p, PackedMaster):
                continue
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name}: parameter {index} is {p.dtype}; the fused step updates float32 or bfloat16 "
                                 f"masters (a complex parameter as two real ones: torch.view_as_real)")
            w = _local(p)
            if not w.is_contiguous():  # the fused step writes the weight in place, element by element
                raise ValueError(f"{name}: parameter {index} (shape {tuple(p.shape)}, strides {w.stride()}) is "
                                 f"not contiguous, and the fused step updates it in place; store it contiguous "
                                 f"(p.data = p.data.contiguous()) before the first step")

    def _general_step(self, group: dict, base: int) -> None:
        """One step of ``group`` through per-parameter states, bucketed by (step, device, dtypes); its parameters
        were checked by :meth:`step` (:meth:`_check_params`)."""
        names = STATE_NAMES[self.algorithm]
        buckets: dict = {}
        for index, p in enumerate(group["params"], base):
            if p.grad is None:
                continue
            st = self._init_state(p)
            st["step"] += 1
            step = st["step"]
            if isinstance(p, PackedMaster):
                self._packed_step(p, p.grad, [_local(st[n]) for n in names], self._scalars(group, step),
                                  mix_seed(self.seed, "optim", step, index))
                continue
            w, g = _local(p), _local(p.grad)
            if not g.is_contiguous():
                g = g.contiguous()
            states = [_local(st[n]) for n in names]
            b = buckets.setdefault((step, w.device, w.dtype, g.dtype, states[0].dtype), ([], [], [], []))
            for lst, v in zip(b, (w, g, states, index)):
                lst.append(v)
        for (step, *_), (ws, gs, sts, streams) in buckets.items():
            optim_step_multi(self.algorithm, ws, gs, sts, self._scalars(group, step), rounding=self.rounding,
                             seed=mix_seed(self.seed, "optim", step), streams=streams, backend=self.backend)

    def _packed_step(self, p: PackedMaster, g: torch.Tensor, states: list, s, seed: int) -> None:
        # the FP32 update of the fused step, then one rounding into the packed format
        w32 = read_master(p)
        new_w, new_states = optim_update(self.algorithm, w32, g.float(), [t.float() for t in states], s)
        gen = torch.Generator(device=p.device).manual_seed(seed) if self.rounding == "stochastic" else None
        write_master(p, new_w, self.rounding, gen)
        if self.algorithm == "kahan":
            new_states[2] = new_states[2] - (read_master(p) - w32)
        for t, v in zip(states, new_states):
            t.copy_(v)


class _Plan:
    """A parameter group's fused buckets, kept between steps while nothing about the group changes:
    the same parameter list and Parameters, every parameter with a gradient (contiguous) and one step count, the
    same rounding and backend, the same state dicts and tensors (``load_state_dict`` drops every plan; a reset
    of ``opt.state`` is seen at the next step). A step
    then costs the gradients' addresses and one launch per bucket (host time was the fused step's
    bottleneck: `docs/benchmarks.md` round 7)."""

    @classmethod
    def build(cls, opt: MasterOptimizer, group: dict, base: int):
        params = group["params"]
        if not params or any(p.grad is None for p in params):
            return None
        sts = [opt.state[p] for p in params]
        if len({st["step"] for st in sts}) != 1:
            return None
        self = cls()
        self.params, self.n, self.base, self.cfg = params, len(params), base, (opt.rounding, opt.backend)
        self.replacements = master.REPLACEMENTS[0]  # a parameter replaced since: the general step refuses it
        self.states, self.count = sts, sts[0]["step"]
        self.members = list(params)  # the list's elements: a Parameter swapped in place must not take another's moments
        self.names = names = STATE_NAMES[opt.algorithm]
        self.tensors = [[st[n] for n in names] for st in sts]
        self.local = any(hasattr(p, "_local_tensor") for p in params)
        self.packed = [i for i, p in enumerate(params) if isinstance(p, PackedMaster)]
        groups: dict = {}
        for i, p in enumerate(params):
            if not isinstance(p, PackedMaster):
                w, g, s0 = _local(p), _local(p.grad), _local(sts[i][names[0]])
                groups.setdefault((w.device, w.dtype, g.dtype, s0.dtype), []).append(i)
        self.buckets = [(idx, MultiTensorStep(opt.algorithm, [[_local(sts[i][n]) for n in names] for i in idx],
                                              [base + i for i in idx], rounding=opt.rounding, backend=opt.backend))
                        for idx in groups.values()]
        self.whole = len(self.buckets) == 1 and len(self.buckets[0][0]) == self.n
        return self

    def _same_state(self, opt: MasterOptimizer, params: list) -> bool:
        """Whether the group still holds the Parameters and ``opt.state`` the very state dicts, tensors and step
        counts the buckets were built over: a user's reset (``opt.state.clear()``, a moment replaced by zeros,
        as torch.optim allows) must reach the step, not leave it on hidden copies."""
        state = opt.state
        for p, q, st, ts in zip(params, self.members, self.states, self.tensors):
            if p is not q or state.get(p) is not st or st.get("step") != self.count:
                return False
            for n, t in zip(self.names, ts):
                if st.get(n) is not t:
                    return False
        return True

    def step(self, opt: MasterOptimizer, group: dict, base: int) -> bool:
        """One step of the group; False (nothing done) if the plan no longer fits it."""
        params = group["params"]
        if params is not self.params or len(params) != self.n or base != self.base or \
                self.cfg != (opt.rounding, opt.backend) or master.REPLACEMENTS[0] != self.replacements:
            return False
        if not self._same_state(opt, params):
            return False
        gs = [p.grad for p in params]
        for g in gs:
            if g is None:
                return False
        if self.local:
            ws, gs = [_local(p) for p in params], [_local(g) for g in gs]
        else:
            ws = params
        if not all(map(torch.Tensor.is_contiguous, gs)):
            return False
        step = self.count = self.count + 1
        for st in self.states:
            st["step"] = step
        s = opt._scalars(group, step)
        seed = mix_seed(opt.seed, "optim", step)
        if self.whole:
            self.buckets[0][1](ws, gs, s, seed)
        else:
            for idx, fused in self.buckets:
                fused([ws[i] for i in idx], [gs[i] for i in idx], s, seed)
        for i in self.packed:  # the state tensors are the kept ones (_same_state checked them)
            opt._packed_step(params[i], gs[i], [_local(t) for t in self.tensors[i]], s,
                             mix_seed(opt.seed, "optim", step, base + i))
        return True
