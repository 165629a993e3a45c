"""Which forward a recomputed forward repeats: the bookkeeping that gives a converted layer's forward, run again in
backward by ``torch.utils.checkpoint``, the random bits of the forward it repeats.

A layer that draws random bits (stochastic rounding, random Hadamard signs) seeds each training call from its call
index (:meth:`adahop.nn.LowPrecisionLinear.generator`). Each call waits in a per-GEMM queue of :class:`Call` until the
recompute that repeats it; this module picks that call, for non-reentrant and reentrant checkpoints, several
micro-batches' forwards run before their backwards, parallel branches and nested checkpoints.
``docs/integrations.md`` says what is matched and what raises; ``tests/test_nn.py`` checks each case bit for bit
against the run without checkpoints."""

from __future__ import annotations

import collections
import sys
import weakref

import torch


class Call:
    """A training call of one GEMM of a layer, waiting for the recompute that repeats it.

    Attributes:
        index: the call index that seeds the call's generator.
        node: weak reference to the autograd node that the recompute's backward reaches it by: the layer output's
            node, or the node of the reentrant checkpoint it ran in; None until bound (a frozen layer's call).
        region: weak reference naming its checkpoint region: the innermost non-reentrant checkpoint's unpack hook,
            or a reentrant checkpoint's node; None outside a checkpoint.
        hooks: weak references naming the non-reentrant checkpoint regions the call ran in, innermost first
            (:func:`hook_chain`).
        enclosing: weak references to the nodes of the reentrant checkpoints whose no-grad forward it ran in,
            innermost first.
        repeats: how many recomputes of enclosing regions have repeated it so far.
    """

    __slots__ = ("index", "node", "region", "hooks", "enclosing", "repeats")

    def __init__(self, index: int):
        self.index, self.node, self.enclosing, self.repeats = index, None, (), 0
        self.hooks = hook_chain()
        self.region = self.hooks[0] if self.hooks else None

    def detached(self) -> "Call":
        """A copy with the index and repeats and no reference to this process's autograd graph or checkpoint
        regions (weak references do not pickle): what a deep copy or pickle of a layer keeps of a queued call."""
        new = Call.__new__(Call)
        new.index, new.node, new.region, new.hooks, new.enclosing, new.repeats = self.index, None, None, (), (), self.repeats
        return new

    def bind(self, node) -> None:
        """Give the call the autograd ``node`` its recompute finds it by (the layer output's), or None."""
        self.node = None if node is None else weakref.ref(node)

    def bind_reentrant(self, nodes: list) -> None:
        """Bind a call made in a reentrant checkpoint's no-grad forward to the ``nodes`` of the reentrant checkpoints
        it runs in, innermost first (:func:`enclosing_function_nodes`): the innermost one's backward recomputes it, so
        that node names its region too; none (a no-grad forward under no Function): unbound."""
        self.bind(nodes[0] if nodes else None)
        self.region = self.node
        self.enclosing = tuple(weakref.ref(n) for n in nodes)


def alive(ref):
    """The object a weak reference ``ref`` names, or None (no reference, or its object is gone)."""
    return None if ref is None else ref()


def runs_again() -> bool:
    """True when a layer's forward (not yet inside its own autograd function) is one that backward
    will run again with grad on: a no-grad call inside an autograd.Function's forward (torch runs
    those with grad and forward-mode AD both off, where ``torch.no_grad`` turns off only the first),
    which is what reentrant checkpoints are: ``torch.utils.checkpoint(..., use_reentrant=True)``,
    and the autograd.Function checkpoints of DeepSpeed or Megatron-LM (built so; not run here).
    ``torch.inference_mode`` turns both off as well, and is an evaluation: never a rerun."""
    return (not torch.is_grad_enabled() and not torch._C._is_fwd_grad_enabled()
            and not torch.is_inference_mode_enabled())


def _hook_stack() -> list:
    """The unpack hooks of the saved-tensor hook stack, innermost first. Torch shows only the top pair: the others
    are read by popping the stack and pushing it back."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # no hooks then, and none may be pushed back
        return []
    pairs = []
    try:
        while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)):
            pairs.append(top)
            torch._C._autograd._pop_saved_tensors_default_hooks()
    finally:
        for pack, unpack in reversed(pairs):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return [unpack for _, unpack in pairs]


def _checkpoint_kind(fn) -> str | None:
    """"forward" for the unpack hook of a non-reentrant checkpoint's region (installed while its forward runs, and
    alive while its graph waits), "recompute" for the one its recompute runs under, None for any other hook (a
    user's, or ``save_on_cpu``'s): those name no region."""
    if getattr(fn, "__module__", None) != "torch.utils.checkpoint":
        return None
    return "recompute" if "_recomputation_hook" in getattr(fn, "__qualname__", "") else "forward"


def innermost_checkpoint_hook():
    """The innermost unpack hook of torch.utils.checkpoint on the saved-tensor hook stack, or None outside a
    non-reentrant checkpoint's forward or recompute."""
    return next((fn for fn in _hook_stack() if _checkpoint_kind(fn) is not None), None)


def in_checkpoint() -> bool:
    """Whether a non-reentrant checkpoint's forward or recompute runs (its saved-tensor hooks are on)."""
    return innermost_checkpoint_hook() is not None


def hook_chain() -> tuple:
    """Weak references to the unpack hooks of the non-reentrant checkpoint regions a call runs in, innermost first:
    each such region installs one for its forward, alive while its graph waits, so the chain names the regions."""
    return tuple(weakref.ref(fn) for fn in _hook_stack() if _checkpoint_kind(fn) == "forward")


def _same_closure(frame, fn) -> bool:
    """Whether the Python ``frame`` is a call of the function object ``fn``: its code, and each of its free variables
    bound to what ``fn``'s closure holds (closures of one ``def`` share their code object)."""
    if frame.f_code is not fn.__code__ or not fn.__closure__:
        return False
    local = frame.f_locals  # free variables are among a frame's locals
    try:
        return all(local.get(name, local) is cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__))
    except ValueError:  # an empty cell
        return False


def running_hook(queue: list[Call]):
    """The unpack hook of the non-reentrant region whose recompute runs now, among the regions ``queue``'s calls ran
    in, or None. A non-reentrant checkpoint recomputes a region inside the unpack hook its forward ran under, so the
    innermost call of such a hook on the Python stack names the region, wherever backward happens to start the
    recompute (a parallel branch that reaches no other branch's forward, as in a GPT-NeoX block). None too when the
    innermost running one is a region none of the calls ran in."""
    hooks = {}
    for c in queue:
        for h in c.hooks:
            if (fn := alive(h)) is not None and hasattr(fn, "__code__"):
                hooks[id(fn)] = fn
    if not hooks:
        return None
    codes = {fn.__code__ for fn in hooks.values()}
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in codes:  # the innermost recompute running now
            return next((fn for fn in hooks.values() if _same_closure(f, fn)), None)
        f = f.f_back
    return None


class _Reach:
    """The autograd nodes reachable from ``start`` through ``next_functions``, found lazily (breadth
    first) and kept: every converted layer that one checkpointed region recomputes asks from the
    same node (the one whose saved tensors backward was unpacking), so the walk is shared."""

    def __init__(self, start):
        self.start, self.seen, self.frontier = start, {id(start)}, collections.deque([start])

    def has(self, node) -> bool:
        key = id(node)
        while key not in self.seen and self.frontier:
            for nxt, _ in self.frontier.popleft().next_functions:
                if nxt is not None and id(nxt) not in self.seen:
                    self.seen.add(id(nxt))
                    self.frontier.append(nxt)
        return key in self.seen


_REACH: list = [None]  # the running recompute's _Reach; cleared when its backward ends (it holds graph nodes)


def _forget_reach() -> None:
    _REACH[0] = None


def _reach() -> _Reach | None:
    """The nodes reachable from the autograd node that runs now (None outside a node, or when torch cannot say which
    runs), shared by every call of the recompute it runs."""
    current = torch._C._current_autograd_node()
    if current is None:
        return None
    if _REACH[0] is None or _REACH[0].start is not current:
        if _REACH[0] is None:  # dropped at the end of this backward: its nodes (and the parameters behind them) stay no longer
            torch.autograd.Variable._execution_engine.queue_callback(_forget_reach)
        _REACH[0] = _Reach(current)
    return _REACH[0]


def enclosing_function_nodes() -> list:
    """The autograd nodes of the ``autograd.Function`` calls whose ``forward`` runs the caller (their ``ctx``, found on
    the Python stack), innermost first: for a reentrant checkpoint's no-grad forward, the first is the node whose
    backward will recompute it (torch's ``CheckpointFunction``, and those built like it), and the others those of
    the checkpoints it is nested in."""
    nodes, f = [], sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name == "forward" and "ctx" in code.co_varnames[:code.co_argcount]:
            ctx = f.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.BackwardCFunction):
                nodes.append(ctx)
        f = f.f_back
    return nodes


def _oldest_of_region(queue: list[Call], i: int) -> int:
    """``i``, or the oldest call in ``queue`` from the same checkpoint region as call ``i``: a recompute replays
    its region in forward order, so a layer called twice there takes its first call's bits first."""
    region = alive(queue[i].region)
    if region is None:
        return i
    return next(k for k, c in enumerate(queue) if alive(c.region) is region)


def recomputed(queue: list[Call]) -> int:
    """The position in ``queue`` of the call that the running recompute repeats: the oldest waiting call of the
    non-reentrant region being recomputed, when the stack names it (:func:`running_hook`); else the latest whose node
    the backward reaches from the node it runs now, then the oldest call of that one's region. Forwards of a graph
    this backward does not reach (a later forward whose backward comes later) are passed over. A call without a node
    (a frozen layer's) is taken as it comes, as are all when torch cannot say which node runs.

    Raises:
        RuntimeError: several forwards wait and the running node reaches none of them."""
    if len(queue) == 1:
        return 0
    hook = running_hook(queue)
    for k, c in enumerate(queue if hook is not None else ()):
        if alive(c.region) is hook:  # the region being recomputed, found on the stack: its oldest waiting call
            return k
    reach = _reach()
    if reach is None:
        return _oldest_of_region(queue, len(queue) - 1)
    for i in range(len(queue) - 1, -1, -1):
        node = alive(queue[i].node)
        if queue[i].node is None or (node is not None and reach.has(node)):
            return _oldest_of_region(queue, i)
    live = sum(alive(c.node) is not None for c in queue)
    if live > 1:  # several forwards' graphs wait and none is reached from here: any pick could be the wrong one
        raise RuntimeError(
            "adahop: a checkpointed region is recomputed from a node that reaches none of the forwards waiting for "
            f"their backward ({live} of this layer's); its random bits cannot be matched to the right forward (several "
            "forwards run before their backwards, under a checkpoint whose region cannot be named: a reentrant one, or "
            "one that runs only when gradients are on, inside another). Run each micro-batch's backward right after its "
            "forward, or checkpoint with use_reentrant=False")
    return len(queue) - 1


def _repeat(queue: list[Call], candidates: list[int]) -> int:
    """The position of the call that a nested region's forward, run again by an enclosing region's recompute,
    repeats: of the ``candidates``, the oldest that the fewest enclosing recomputes have repeated yet, so a layer
    called twice there, or in two nested regions, takes its calls in forward order, and a region nested two deep is
    repeated once by each enclosing recompute. The call stays waiting for its own region's recompute."""
    k = min(candidates, key=lambda i: (queue[i].repeats, i))
    queue[k].repeats += 1
    return k


def _nested_in(queue: list[Call], hook) -> list[int]:
    """The positions of the calls made in regions nested inside the non-reentrant region of ``hook``."""
    return [i for i, c in enumerate(queue) if any(alive(h) is hook for h in c.hooks) and alive(c.region) is not hook]


def repeat_nested(queue: list[Call]) -> int | None:
    """The position of the call that a forward run inside backward repeats without using it up, when that forward
    is a nested region's, run again by the recompute of a region it is nested in (its own recompute comes later and
    takes the call then); None when it is a recompute of its own region (:func:`recomputed`)."""
    if not any(c.hooks for c in queue):
        return None  # no call ran in a non-reentrant region, so none is nested in one
    top = innermost_checkpoint_hook()
    if top is None or _checkpoint_kind(top) != "forward":
        return None  # not the forward of a non-reentrant checkpoint: a recompute, or no checkpoint
    hook = running_hook(queue)
    found = _nested_in(queue, hook) if hook is not None else []
    if not found:  # the region being recomputed is not named on the stack: the forward the backward reaches
        found = [recomputed(queue)]
    return _repeat(queue, found)


def repeat_rerun(queue: list[Call]) -> tuple[int, bool]:
    """The position of the call that a reentrant checkpoint's no-grad forward repeats when backward runs it again
    (the recompute of a region it is nested in), and whether to bind the call to the reentrant node of this run: a
    reentrant recompute builds the graph that backward then runs, so the nested region's own recompute starts from
    its new node. Inside a non-reentrant region being recomputed, the calls made in reentrant regions within it;
    inside a reentrant one, those whose checkpoint node is the one running (else one the backward reaches)."""
    hook = running_hook(queue)
    found = _nested_in(queue, hook) if hook is not None else []
    rebind = False
    if not found and hook is None:
        current = torch._C._current_autograd_node()
        found = [i for i, c in enumerate(queue) if current is not None and any(alive(n) is current for n in c.enclosing)]
        reach = _reach() if not found else None
        if reach is not None:
            found = [i for i, c in enumerate(queue) if any((n := alive(r)) is not None and reach.has(n) for r in c.enclosing)]
        rebind = bool(found) and not in_checkpoint()
    k = _repeat(queue, found or list(range(len(queue))))
    return k, rebind
