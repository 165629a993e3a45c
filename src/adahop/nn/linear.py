"""`LowPrecisionLinear`: a drop-in for `nn.Linear` whose GEMMs follow a recipe, and the
`Controller` that a converted model shares (seed, step, calibration, plan)."""

from __future__ import annotations

import operator
import warnings
import weakref

import torch
from torch import nn

from ..patterns import Calibrator, Plan
from ..recipes.spec import GEMMS, GemmSpec, Recipe
from ..utils import mix_seed
from . import opaque, replay
from .opaque import specs_digest
from .function import LowPrecisionLinearFn, fprop, salt
from .shared_cast import shared_cast


__all__ = ["LowPrecisionLinear", "Controller"]


def plan_for_another_model(name: str, plan: Plan, missing: int = 1) -> ValueError:
    """The error for a ``plan`` without an entry for converted layer ``name`` (``missing`` such layers)."""
    return ValueError(f"the plan has no entry for layer {name!r}" + (f" ({missing} missing)" if missing > 1 else "")
                      + f"; it was made for another model (its layers: {list(plan.layers)[:3]}...). Calibrate this "
                      "model instead, or pass its own plan")


def check_plan_shapes(plan: Plan, layers: list[tuple[str, int, int]]) -> None:
    """Raise a ValueError when ``plan`` records another ``[in, out]`` for one of ``layers`` ``(name, in, out)``:
    the same names, other widths, so patterns voted on another model. Plans without shapes pass."""
    other = [(n, [i, o], plan.shapes[n]) for n, i, o in layers
             if plan.shapes and n in plan.shapes and plan.shapes[n] != [i, o]]
    if other:
        n, here, there = other[0]
        raise ValueError(f"the plan was frozen on another model: layer {n!r} is {here[0]}->{here[1]} here and "
                         f"{there[0]}->{there[1]} in the plan ({len(other)} such layers). Calibrate this model instead, "
                         "or pass its own plan")


class Controller:
    """State shared by every converted layer of one model.

    It owns the run seed and the optimizer step (the stochastic-rounding and random-sign streams
    are seeded from seed, step, layer and GEMM), and for AdaHOP recipes the :class:`Calibrator`
    and the frozen :class:`Plan`. The training loop calls :func:`adahop.on_step` once per
    optimizer step; that is the only hook (STYLE §2.8).
    """

    def __init__(self, recipe: Recipe, *, seed: int = 0, plan: Plan | None = None):
        plan = self._for_recipe(recipe, plan)
        self.recipe, self.seed, self.step, self.plan = recipe, seed, 0, plan
        cal = recipe.calibration
        self.calibrator = Calibrator.from_spec(cal) if cal and plan is None else None
        self._layers: list[weakref.ref] = []
        self.unquantizable: list[str] = []  # layers the recipe cannot quantize (their shape): BF16 GEMMs
        # called with the Calibrator right before the plan freezes; data parallelism sets it to
        # merge every rank's observations, so that all ranks freeze the same plan
        self.agree = None
        self.step_hook = None  # the handle of register_step_hook's optimizer hook, so that a second one is refused
        # under torch.compile, per-call random signs are hashed from this seed and the layer (a graph
        # input changed only between calls, in place, by on_step and seed_compiled_rng): the compiled
        # backward may recompute forward values, and a traced RNG op or a counter mutated in the graph
        # then gave dY other signs than X (issue 24 §0). It lives on the layers' device
        # (place_sign_seed): a CPU seed is a host-to-device copy in every step, which a CUDA graph
        # cannot capture
        self.sign_seed = torch.tensor(self.sign_seed_value(0), dtype=torch.int64)

    @staticmethod
    def _for_recipe(recipe: Recipe, plan: Plan | None) -> Plan | None:
        """``plan`` under ``recipe``'s strategy table: a plan frozen with another table (an Lv2 run's
        plan given to an Lv1 recipe) is re-mapped from its voted patterns, with a warning, rather
        than run as the other level's strategies under this recipe's name."""
        cal = recipe.calibration
        if plan is None or cal is None or plan.table == cal.table:
            return plan
        warnings.warn(f"adahop: the plan was frozen with strategy table {plan.table!r}; recipe {recipe.name!r} uses table "
                      f"{cal.table!r}, so its strategies are re-derived from the plan's patterns", stacklevel=3)
        return plan.with_table(cal.table)

    def __getstate__(self) -> dict:
        # copy.deepcopy / pickle of a converted model: the weak references to the layers are not
        # copied (each copied layer registers with the copied controller as it is restored, see
        # LowPrecisionLinear.__setstate__), nor is the data-parallel hook, which belongs to one run
        state = self.__dict__.copy()
        state["_layers"], state["agree"], state["step_hook"] = [], None, None
        return state

    @property
    def layers(self) -> list["LowPrecisionLinear"]:
        """The live converted layers of this model, in conversion order."""
        return [r() for r in self._layers if r() is not None]

    @property
    def calibrating(self) -> bool:
        """True while an AdaHOP recipe is still collecting patterns (no plan yet)."""
        return self.recipe.calibration is not None and self.plan is None

    def register(self, layer: "LowPrecisionLinear") -> None:
        """Track ``layer`` (weakly) so that plan changes reach it."""
        self._layers.append(weakref.ref(layer))

    def sign_seed_value(self, step: int, micro: int = 0) -> int:
        """The compiled path's sign seed for micro-batch ``micro`` of 0-based step ``step`` (32 bits)."""
        return mix_seed(self.seed, step, "compiled", *((micro,) if micro else ()), "signs") & 0xFFFFFFFF

    def seed_signs(self, step: int, micro: int = 0) -> None:
        """Set :attr:`sign_seed`, in place, to :meth:`sign_seed_value` (a meta seed holds no value: left as it is)."""
        if self.sign_seed.device.type != "meta":
            self.sign_seed.fill_(self.sign_seed_value(step, micro))

    def place_sign_seed(self, device: torch.device) -> None:
        """Keep :attr:`sign_seed` on ``device`` (the layers'); call before compiling, never between replays."""
        device = torch.device(device)
        if self.sign_seed.device == device:
            return
        if self.sign_seed.device.type == "meta":
            # a meta seed holds no value to copy (a model built or moved to meta, then to_empty): rebuild
            # the value on_step would have set
            self.sign_seed = torch.tensor(self.sign_seed_value(self.step), dtype=torch.int64, device=device)
        else:
            self.sign_seed = self.sign_seed.to(device)

    def on_step(self, step: int) -> bool:
        """Record that ``step`` optimizer steps are done; freeze the plan when calibration ends.
        Returns True on the step the plan is frozen.

        It also sets :attr:`sign_seed` to step ``step``'s value, so that a compiled model in a
        loop that calls only :func:`adahop.on_step` draws fresh random signs every step, as eager
        mode does (the same value :func:`adahop.nn.seed_compiled_rng` sets for micro-batch 0).

        A ``step`` below the one recorded is warned about: random bits are seeded by step, so the steps
        from there repeat the earlier steps' bits (what a deliberate replay wants, and a counter bug does not;
        a checkpoint's state is restored with :func:`adahop.nn.convert.load_controller_state`)."""
        try:  # a float or True seeded the random bits by a step no run counts
            n = -1 if isinstance(step, bool) else operator.index(step)  # ints, NumPy's and 0-d int tensors
        except TypeError:
            n = -1
        if n < 0:
            raise TypeError(f"adahop.on_step: step={step!r}; pass the number of optimizer steps done, an int >= 0")
        step = n
        if step < self.step:
            warnings.warn(f"adahop.on_step({step}) after step {self.step}: the steps from {step} on repeat the random "
                          "bits already drawn for them (they are seeded by step). To go back to a checkpoint, load its "
                          "AdaHOP state with adahop.nn.convert.load_controller_state", stacklevel=3)
        self.step = step
        self.seed_signs(step)
        if self.calibrating and step >= self.recipe.calibration.steps:
            if self.agree is not None:
                self.agree(self.calibrator)
            live = [l for l in self.layers if not l.force_bf16]
            plan = self.calibrator.freeze([l.name for l in live])
            plan.shapes = {l.name: [l.in_features, l.out_features] for l in live}
            self.set_plan(plan)
            return True
        return False

    def set_plan(self, plan: Plan) -> None:
        """Adopt ``plan`` (frozen by calibration, loaded from a checkpoint or ``plan.json``).

        Raises:
            ValueError: ``plan`` has no entry for a converted layer, or records another shape for one (made
                for another model); the controller is left as it was (still calibrating, or with its old plan)."""
        plan = self._for_recipe(self.recipe, plan)
        if self.recipe.calibration is not None:
            missing = [l.name for l in self.layers if not l.force_bf16 and l.name not in plan.layers]
            if missing:
                raise plan_for_another_model(missing[0], plan, len(missing))
            check_plan_shapes(plan, [(l.name, l.in_features, l.out_features) for l in self.layers if not l.force_bf16])
        self.plan = plan
        self.calibrator = None
        for layer in self.layers:
            layer.resolve_specs()


_WARNED: set[str] = set()  # the once-per-process warnings given so far


def _warn_once(key: str, message: str) -> None:
    """``message`` as a UserWarning the first time ``key`` comes in this process, pointed at the user's call of the
    layer (called from :meth:`LowPrecisionLinear._forward`)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


class LowPrecisionLinear(nn.Linear):
    """``nn.Linear`` whose fprop, dgrad and wgrad run under ``recipe``.

    Same ``weight`` [out_features, in_features] and ``bias`` Parameters (the very objects of the
    converted layer) and the same state_dict keys. Input ``[..., in_features]`` in any float
    dtype; under autocast the GEMMs run in the autocast dtype. Build it with :meth:`from_linear`.
    """

    def __init__(self, *args, **kwargs):
        # nn.Linear's constructor would make a layer with no recipe or controller, failing at its first call
        raise TypeError("LowPrecisionLinear is made from an nn.Linear under a recipe: adahop.convert_model(model, "
                        "'adahop-lv2') converts a model's linears; LowPrecisionLinear.from_linear(linear, recipe, name=..., "
                        "layer_id=..., controller=...) wraps one (integrations)")

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Recipe, *, name: str, layer_id: int, controller: Controller,
                    backend: str = "reference", force_bf16: bool = False) -> "LowPrecisionLinear":
        """Wrap ``mod`` (keeping its weight and bias Parameters) to run ``recipe``; ``name`` is its qualified name, ``layer_id`` its index in the model (it seeds the random streams), ``force_bf16`` keeps its GEMMs exact.

        Raises:
            TypeError: ``controller`` is not a :class:`Controller` (``convert_model`` makes one per model)."""
        if not isinstance(controller, Controller):
            raise TypeError(f"from_linear: controller={controller!r}; pass the model's Controller (adahop.nn.Controller"
                            "(recipe), shared by all its layers), or let adahop.convert_model make it")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = mod.in_features, mod.out_features
        new.weight, new.bias = mod.weight, mod.bias
        new.recipe, new.name, new.layer_id, new.backend = recipe, name, layer_id, backend
        # GEMMs too small for the fast path (recipe.bf16_small_gemms), decided once from the shape;
        # a layer with all three so is an exact nn.Linear, as the recipe's BF16 edge layers are
        new.small_bf16 = () if force_bf16 else recipe.small_bf16_gemms(mod.in_features, mod.out_features)
        new.controller, new.force_bf16 = controller, force_bf16 or len(new.small_bf16) == len(GEMMS)
        new.saved_bytes, new.patterns, new._calls, new._unbound = 0, {}, {}, []
        new._specs, new.recompute_x = None, False
        controller.register(new)
        controller.place_sign_seed(new.weight.device)
        opaque.register(new)
        new.resolve_specs()
        return new

    def __getstate__(self) -> dict:
        # the queued forwards' autograd nodes belong to this process's graph (and weak references do not pickle)
        state = self.__dict__.copy()
        state["_calls"] = {k: [v[0], [e.detached() for e in v[1]]] for k, v in self._calls.items()}
        state["_unbound"] = []
        return state

    def __setstate__(self, state: dict) -> None:
        # restored by copy.deepcopy or pickle: join the (copied) controller, which does not copy its
        # weak references to the original's layers
        state.setdefault("_unbound", [])
        state.setdefault("recompute_x", False)
        super().__setstate__(state)
        self.controller.register(self)
        opaque.register(self)

    # -- plan and specs ----------------------------------------------------------------------
    def resolve_specs(self) -> None:
        """Fix the spec of each GEMM: 'calibrated' strategies come from the controller's plan."""
        self._resolve_specs()
        # the opaque ops take this as a graph constant: a compiled graph of other specs refuses to run
        # (adahop.nn.opaque). A digest of the content, not a counter: two processes that number their
        # layers alike (two recipes, or two plans, run side by side) must not share an Inductor/AOT cache
        # entry, whose graph bakes in the other one's saved tensors (round 15: "expected size 256==8192")
        self._specs_version = specs_digest(self._specs, self.backend, self.recompute_x)

    def set_recompute_x(self, on: bool) -> None:
        """Save the input X by reference for backward (``on``), which then prepares it for wgrad, instead of
        saving the prepared operand: for a layer inside a block under selective recompute
        (:mod:`adahop.nn.recompute`), whose backward recomputes X. The numbers stay the same."""
        self.recompute_x = bool(on)
        # the opaque ops' saved outputs change with it: compiled graphs and caches must tell the two apart
        self._specs_version = specs_digest(self._specs, self.backend, self.recompute_x)

    def _resolve_specs(self) -> None:
        if self.force_bf16 or self.recipe.is_bf16:
            self._specs = None
            return
        plan = self.controller.plan
        specs: dict[str, GemmSpec] = {}
        for g in GEMMS:
            spec = self.recipe.gemm(g)
            if spec.strategy == "calibrated":
                if plan is None:
                    self._specs = None  # still calibrating
                    return
                spec = spec.with_strategy(plan.strategy(self.name, g))
            if g in self.small_bf16:
                spec = spec.with_strategy("bf16")
            elif g == "wgrad" and spec.strategy == "iht+oe_left":
                spec = self._wgrad_oe_left_as_iht(spec)
            specs[g] = spec
        self._specs = specs
        self._warm_constants()
        if plan is not None and self.name in plan.layers:
            # a hand-written plan may give only the strategies (Plan.from_dict requires no patterns): describe shows "-"
            self.patterns = {k: plan.layers[self.name][k] for k in ("x", "w", "dy") if k in plan.layers[self.name]}

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        # moved to another device: its constants and the controller's sign seed too (Controller.place_sign_seed)
        self.controller.place_sign_seed(self.weight.device)
        self._warm_constants()
        return out

    def _warm_constants(self) -> None:
        # the device copies of the constants the GEMMs read (adahop.device_constants), made now, eagerly:
        # else the first compiled call makes them, and under mode="reduce-overhead" that call allocates
        # from the CUDA-graph pool
        if getattr(self, "_specs", None) is None or self.weight.device.type == "meta":
            return
        from ..formats.e2m1 import _grid
        from ..gemm import draw_signs
        from ..hadamard import _warm_hadamard
        from ..kernels.fold import _fold_table
        from ..kernels.nvfp4_matmul import _byte_pairs

        dev = self.weight.device
        _grid(dev)
        _fold_table(dev)
        for spec in self._specs.values():
            if spec.transform is not None and spec.transform.signs == "fixed":
                draw_signs(spec, None, dev)
            for tr in (spec.transform, spec.outer_a, spec.outer_b):  # the Hadamard blocks / Kronecker factors
                if tr is not None:
                    _warm_hadamard(tr.block_size, dev)
            if "nvfp4" in (spec.a.fmt, spec.b.fmt):  # the NVFP4 GEMM's byte-to-values table
                _byte_pairs(dev)

    def _wgrad_oe_left_as_iht(self, spec: GemmSpec) -> GemmSpec:
        # OE-Left on wgrad would need X in BF16, which is saved quantized for memory: the official
        # code runs plain IHT inside the GEMM instead, whatever the plan's source (`specs/adahop.md`
        # §4); tables never assign it (strategy_for), a hand-written plan or recipe may
        if not getattr(self.controller, "_warned_wgrad_oe_left", False):
            self.controller._warned_wgrad_oe_left = True
            warnings.warn(f"adahop: {self.name} (and any other layer so planned): wgrad 'iht+oe_left' runs as 'iht', "
                          "as in the official code (OE-Left is not supported on wgrad)", stacklevel=4)
        return spec.with_strategy("iht")

    def current_specs(self) -> dict[str, GemmSpec] | None:
        """The resolved specs, or None when this call runs exact BF16 GEMMs."""
        return None if self.controller.calibrating and not self.force_bf16 and not self.recipe.is_bf16 else self._specs

    def strategies(self) -> dict[str, str]:
        """Strategy per GEMM as shown by :func:`adahop.describe`."""
        if self.force_bf16 or self.recipe.is_bf16:
            return {g: "bf16" for g in GEMMS}
        if self._specs is None:
            return {g: "calibrating" for g in GEMMS}
        return {g: s.strategy for g, s in self._specs.items()}

    # -- randomness and calibration hooks ----------------------------------------------------
    def generator(self, gemm: str, stream: str = "train", rerun: bool = False) -> torch.Generator | None:
        """A generator for this call's stochastic rounding / random signs, seeded from
        (run seed, step, layer, GEMM, call index); None when the GEMM draws nothing, and under
        torch.compile (the default generator is used; see :func:`adahop.nn.seed_compiled_rng`).
        ``stream="eval"`` (forward-only calls) counts its calls apart and seeds another stream, so
        that evaluating between steps never shifts the training draws. A forward that
        ``torch.utils.checkpoint`` runs again during backward is no new call: it takes the bits of
        the forward it recomputes, so checkpointing leaves every number as it was. That holds for
        ``use_reentrant=False`` and ``True`` (and other checkpoints built as an autograd.Function:
        their first forward is a training call, see :meth:`_forward_only`); ``rerun`` marks such a
        forward (a no-grad forward that backward runs again). Several forwards may wait for their
        backwards (micro-batches run forward first): a recompute takes the one whose autograd graph
        the running backward reaches (:func:`adahop.nn.replay.recomputed`), and within one checkpoint region its calls in
        forward order; a non-reentrant region being recomputed is found on the stack first, so a region of
        parallel branches (a GPT-NeoX block) is matched too, and so are nested checkpoints (an inner region's
        layers run twice in backward: in the outer recompute and in their own) except a non-reentrant one inside a
        reentrant one. Not matched (documented in `docs/integrations.md`): with several forwards waiting, a frozen
        layer's calls (no autograd node).

        Raises:
            RuntimeError: a recompute that reaches none of several waiting forwards (:func:`adahop.nn.replay.recomputed`);
                a forward of this layer runs inside backward with no forward of this
                step left for it to repeat (a non-reentrant checkpoint inside a reentrant one, a
                second backward through a checkpointed region, ``adahop.on_step`` between a forward
                and its backward, a forward from a backward hook): its bits would differ from the
                forward's."""
        call = self._call_index(gemm, stream, rerun)
        if call is None:
            return None
        g = torch.Generator(device=self.weight.device)
        tag = (gemm,) if stream == "train" else (gemm, stream)  # the training seeds predate the eval stream
        g.manual_seed(mix_seed(self.controller.seed, self.controller.step, self.layer_id, *tag, call))
        return g

    def _call_index(self, gemm: str, stream: str, rerun: bool = False) -> int | None:
        """The call index that seeds :meth:`generator` (None when it returns None), counted per
        (step, GEMM, stream). A training call outside backward takes the next index and queues it
        for a recompute; a forward inside backward takes the latest queued one."""
        spec = (self._specs or {}).get(gemm)
        if spec is None or not spec.draws_random_bits:
            return None
        if torch.compiler.is_compiling() or opaque.in_opaque_layer():
            # a Generator per call cannot be traced (nor replayed from a CUDA graph, in the opaque ops):
            # compiled code draws from the default generator, which the training loop seeds per (run
            # seed, rank, step) — reproducible, fresh per step and per rank, but a different stream from eager mode's
            return None
        step = self.controller.step
        self._calls = {k: v for k, v in self._calls.items() if k[0] == step}
        # [calls so far, the calls of the forwards not yet recomputed (replay.Call)]
        issued = self._calls.setdefault((step, gemm, stream), [0, []])
        queue = issued[1]
        in_backward = torch._C._current_graph_task_id() != -1
        if stream == "train" and not in_backward and queue and replay.running_hook(queue) is not None:
            # a region recomputed outside backward (a saved tensor unpacked by hand): backward recomputes it again,
            # and no call count tells this run's calls apart from new ones, so nothing would match the forward's bits
            raise RuntimeError(
                f"adahop: {self.name}: a checkpointed region was recomputed outside backward (a saved tensor of it "
                "unpacked by hand, such as grad_fn._saved_self), so its random bits cannot be matched to the forward "
                "it repeats. Read saved tensors only in backward, or checkpoint without a recipe that draws random bits")
        if stream == "eval" or not in_backward:  # a new call; a training one may be recomputed later
            call = issued[0]
            issued[0] += 1
            if stream == "train":
                queue.append(replay.Call(call))
                self._unbound.append(queue[-1])  # _forward gives it the output's autograd node
            return call
        if not queue:
            raise RuntimeError(
                f"adahop: {self.name}: a forward ran inside backward with no forward of step {step} left for it to "
                f"repeat, so its {gemm} random bits would differ from the forward's. torch.utils.checkpoint recomputes "
                "each forward once per backward: nest no checkpoint(..., use_reentrant=False) inside a "
                "use_reentrant=True one (nest checkpoints of one kind), run one backward per forward (no retain_graph "
                "through a checkpointed region), and call adahop.on_step only after the step's backward")
        # torch.utils.checkpoint running a forward of this step again (replay): a nested region's forward, run by
        # the recompute of a region it is nested in, keeps the call for its own recompute, which then takes it
        if rerun:  # a reentrant region's no-grad forward
            k, rebind = replay.repeat_rerun(queue)
            if rebind:  # to the new checkpoint node, in _forward_only
                self._unbound.append(queue[k])
            return queue[k].index
        k = replay.repeat_nested(queue)
        return queue[k].index if k is not None else queue.pop(replay.recomputed(queue)).index

    def _bind_calls(self, node=None, reentrant: list | None = None) -> None:
        """Give the calls this forward queued (:attr:`_unbound`) the autograd ``node`` a checkpoint's recompute
        finds them by, or the nodes of the ``reentrant`` checkpoints they ran in (:class:`replay.Call`), and forget
        them."""
        for c in self._unbound:
            if reentrant is None:
                c.bind(node)
            else:
                c.bind_reentrant(reentrant)
        self._unbound.clear()

    def observe(self, tensor: str, t: torch.Tensor) -> None:
        """During calibration, record the pattern of ``tensor`` ("x" [T,K], "w" [N,K] or "dy" [T,N])."""
        cal = self.controller.calibrator
        if cal is not None and not self.force_bf16:
            # one observation per optimizer step: the first call of the step (Calibrator.observe)
            p = cal.observe(self.name, tensor, t, step=self.controller.step)
            if p is not None:
                self.patterns[tensor] = str(p)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Calibration detects patterns with host syncs (`.item()`), so under torch.compile it runs
        # eagerly. Branching here, outside the autograd function, makes dynamo guard on the
        # calibration state: when the plan freezes the model recompiles with the whole layer
        # (fprop + its backward) in one graph instead of keeping a graph break at the layer.
        """``x`` [..., in_features] → [..., out_features]; the GEMMs run in the autocast dtype when autocast is on, else in ``x``'s dtype."""
        if self.controller.calibrating and not self.force_bf16:
            return self._forward_calibrating(x)
        return self._forward(x)

    @torch.compiler.disable
    def _forward_calibrating(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        if x.ndim == 0:
            raise ValueError(f"{self.name}: a 0-d input; the layer takes [..., in_features={self.in_features}]")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input has {x.shape[-1]} features in its last dim, the layer takes "
                             f"in_features={self.in_features} (input shape {tuple(x.shape)})")
        if not x.is_floating_point():
            raise ValueError(f"{self.name}: input of dtype {x.dtype}; the layer takes a floating-point tensor (token ids "
                             "go through the embedding first)")
        x2 = shared_cast(x, dtype).reshape(-1, self.in_features)  # q, k and v keep one copy of their X, not three
        with torch.autocast(device_type=x.device.type, enabled=False):
            if x2.shape[0] == 0:  # no tokens (an MoE expert that got none): nothing to quantize, exact and empty
                b = None if self.bias is None else self.bias.to(dtype)
                return torch.nn.functional.linear(x2, self.weight.to(dtype), b).reshape(*x.shape[:-1], self.out_features)
            params_grad = self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
            if torch.is_grad_enabled() and (x2.requires_grad or params_grad):
                # once each: a model trained in eval mode (dropout off) would see the first on every call
                if not self.training and not torch.compiler.is_compiling():
                    _warn_once("eval_with_grad", (
                        "adahop: a converted layer ran a forward in eval mode with gradients enabled. It counts as a "
                        "training call: its random bits (and, while calibrating, the plan's observations) are the "
                        "training run's, so an evaluation this way changes the training that follows. Evaluate under "
                        "torch.no_grad() or torch.inference_mode()"))
                # a layer marked to save X by reference (adahop.nn.recompute) that no checkpoint recomputes keeps X
                # itself, 16 bits an element where the prepared operand takes 4.25, and saved_bytes does not count it
                if self.recompute_x and not torch.compiler.is_compiling() and not replay.in_checkpoint() \
                        and torch._C._current_graph_task_id() == -1:
                    _warn_once("recompute_outside_checkpoint", (
                        f"adahop: {self.name} saves its input X by reference for a selective recompute (mark_layers / "
                        "selective_recompute), but runs outside a checkpointed region (checkpointing disabled, or the "
                        "model in eval mode, where transformers does not checkpoint): it keeps X in full precision, and "
                        "adahop.saved_bytes leaves it out. Train in model.train(), or call "
                        "adahop.nn.recompute.mark_layers(model, on=False)"))
                if self._compiled_opaque() or self._eager_opaque():  # the layer as two ops (adahop.nn.opaque)
                    y = opaque.lp_linear(self, x2, dtype, self._sign_seed(GEMMS))
                else:
                    self._unbound.clear()
                    y = LowPrecisionLinearFn.apply(x2, self.weight, self.bias, self, dtype, self._sign_seed(GEMMS))
                    if self._unbound:  # eager training calls only (dynamo cannot trace grad_fn)
                        self._bind_calls(y.grad_fn)
            else:
                y = self._forward_only(x2, dtype)
        if x.ndim == 2:
            return y
        # not a view of y, as nn.Linear's output is not: FSDP2 warns of modules returning views
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], self.out_features))

    def _compiled_opaque(self) -> bool:
        # frozen quantized GEMMs under torch.compile, and the opaque form chosen for them (adahop.nn.opaque.layer_form)
        specs = self.current_specs() if torch.compiler.is_compiling() else None
        return specs is not None and opaque.layer_form(specs) == "opaque"

    def _eager_opaque(self) -> bool:
        # under selective recompute in eager mode, a frozen layer that draws no random bits runs as the
        # opaque op, which the checkpoint keeps whole (adahop.nn.recompute); one that draws them runs its
        # forward again in backward, where generator() hands it the bits of the forward it repeats
        if not self.recompute_x or torch.compiler.is_compiling():
            return False
        specs = self.current_specs()
        return specs is not None and not any(s.draws_random_bits for s in specs.values())

    def _sign_seed(self, gemms) -> torch.Tensor | None:
        """The compiled path's seed for this call's per-call signs (None in eager mode, or when none
        of ``gemms`` draws signs per call); :data:`~adahop.nn.function.SALTS` and the layer id
        separate the streams drawn from it."""
        if not torch.compiler.is_compiling() or self._specs is None:
            return None
        if not any(self._specs[g].transform is not None and self._specs[g].transform.signs == "per_call" for g in gemms):
            return None
        return self.controller.sign_seed

    def _forward_only(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # evaluation / no_grad: the training fprop, but nothing is observed by calibration, nothing
        # is prepared for a backward that never comes, and random bits come from the eval stream;
        # so an evaluation between steps leaves the plan and the training draws (and resume) as they were.
        # Two forward-only calls are training calls, on the training stream: a frozen layer's under
        # grad mode, and a no-grad forward that backward runs again (a reentrant checkpoint's)
        specs = self.current_specs()
        spec = None if specs is None else specs["fprop"]
        if specs is None and torch.is_grad_enabled():
            # a training call of a frozen layer (its weight needs no gradient, nor its input: a LoRA model's first
            # layers): X and W vote for its fprop, the one GEMM it runs; unobserved, its plan came from no data
            self.observe("x", x2)
            self.observe("w", self.weight.to(dtype))
        rerun = replay.runs_again() if spec is not None and not torch.compiler.is_compiling() else False
        stream = "train" if rerun or torch.is_grad_enabled() else "eval"
        self._unbound.clear()
        gen = None if spec is None else self.generator("fprop", stream=stream, rerun=rerun)
        if rerun:
            # its recompute draws the saved operands' bits: reserve the calls this forward would have
            # made, so that it takes theirs (as a non-reentrant recompute does) and plain runs match
            self._call_index("wgrad", "train", rerun)
            self._call_index("dgrad", "train", rerun)
            # the checkpoint Function's node, whose backward recomputes this call: its region, too
            self._bind_calls(reentrant=replay.enclosing_function_nodes() if self._unbound else [])
        self._unbound.clear()
        seed = None if spec is None else self._sign_seed(("fprop",))
        return fprop(x2, self.weight.to(dtype), self.bias, spec, gen, self.backend, dtype, seed, salt(self, "fprop"))

    def extra_repr(self) -> str:
        s = self.strategies()
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe.name}, fprop={s['fprop']}, dgrad={s['dgrad']}, wgrad={s['wgrad']}, backend={self.backend}")
