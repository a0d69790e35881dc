"""``GradientBuckets``: a data-parallel step's gradients reduced in buckets while backward runs.

DDP's scheme, on the live generation's group instead of a fixed world:

* parameters are grouped in reverse order of ``model.parameters()`` (about the order their
  gradients become final in backward) into buckets of ``cap_mb`` MiB, the first one of
  ``first_cap_mb`` (DDP's ``bucket_cap_mb`` = 25 and its 1 MiB first bucket);
* a post-accumulate-grad hook on every parameter copies the gradient into its bucket during the
  step's *final* backward (``arm``: the executor arms the member's last micro-batch; the others
  accumulate locally, as under DDP's ``no_sync``), and a bucket whose gradients are all in is
  all-reduced asynchronously at once, buckets in the same order on every member (gloo and NCCL
  pair a group's ops by their order);
* the last bucket (the first layers, final last) is launched by ``launch_rest`` after backward, with
  a tail of control numbers (the step's loss, the members' timings) in its last elements: the
  commit's few numbers ride with the gradients, no collective of their own.

The parameters' own ``.grad`` is never written: it holds this member's local sum, which survives
a failed reduction and is its share of the redone step (``DataParallelExecutor._salvage``).
After a successful reduction the executor points ``.grad`` at the buckets' views for the update
(no copy back).  Memory: local gradients plus buckets, as DDP without ``gradient_as_bucket_view``.

With ``release`` (DDP's ``gradient_as_bucket_view``, for memory) every parameter is hooked and
its ``.grad`` is dropped as soon as the final backward's gradient is in its bucket: one gradient
copy per step, as DDP with that flag.  The local sum is then gone once its bucket is reduced, so
after a failed reduction the member holds nothing of the step (``released``) and recomputes
its share of the redone step.

A parameter whose gradient was not produced in the final backward (unused in this forward, or a
member with nothing to compute this step) is filled by ``launch_rest`` from its ``.grad`` or zeros,
so DDP's ``find_unused_parameters`` needs no flag here (the buckets holding such parameters are
launched at the end instead of during backward).

Compression (``compress``: DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``): each bucket's
gradients are divided by the world size, cast to that dtype, all-reduced so, and cast back and
multiplied by it on arrival, as DDP's hooks do (they leave the mean; the buckets keep the sum).
The commit's tail (the loss, the token count, the timings, the non-finite flag) must arrive
exact: with compression it goes as a small full-precision all-reduce of its own right after the
last bucket's gradients (one more op per step, only then).  Every member decodes the same
reduced values: replicas stay bitwise equal; a step redone after a failure sums other partial
sums, so the trajectory is that of compressed training, within the compressed dtype's rounding.

Limits: one dtype for every trainable parameter (the core checks it); a second backward into a
parameter after its bucket was launched in the same step is refused, as DDP refuses it; failures
of a launch inside a hook are kept and raised by ``launch_rest`` (an exception must not escape into
the user's ``backward()``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from chameleon_ft.runtime.torch_private import foreach_copy

__all__ = ["GradientBuckets", "DEFAULT_CAP_MB", "FIRST_CAP_MB", "COMPRESSIONS"]

DEFAULT_CAP_MB = 25.0  # DDP's bucket_cap_mb default
FIRST_CAP_MB = 1.0  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
COMPRESSIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}  # DDP's two compression hooks


class GradientBuckets:
    """Buckets over ``params`` (see module doc).

    Args:
        params: the trainable parameters, in ``model.parameters()`` order (one dtype).
        cap_mb: bucket size in MiB (``bucket_cap_mb``).
        first_cap_mb: the first bucket's size (the last layers', launched first; at most ``cap_mb``).
        compress: ``"fp16"`` or ``"bf16"``: the gradients reduced in that dtype, the tail in
            full precision (module doc); None: full precision.
        release: drop each parameter's ``.grad`` once it is copied into its bucket (module doc).
    """

    def __init__(self, params: list[torch.nn.Parameter], cap_mb: float = DEFAULT_CAP_MB,
                 first_cap_mb: float = FIRST_CAP_MB, compress: Optional[str] = None,
                 release: bool = False) -> None:
        if cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {cap_mb}")
        if compress is not None and compress not in COMPRESSIONS:
            raise ValueError(f"compress must be one of {sorted(COMPRESSIONS)} or None, got {compress!r}")
        self.compress = COMPRESSIONS[compress] if compress is not None else None
        self._world = 1  # the compression's divisor (``arm``)
        self._coded: list = []  # (gradients' view, their compressed copy) of the launched buckets
        self.params = list(params)
        itemsize = self.params[0].element_size() if self.params else 4
        caps = [max(1, int(min(first_cap_mb, cap_mb) * 2 ** 20) // itemsize),
                max(1, int(cap_mb * 2 ** 20) // itemsize)]
        # Bucket assignment: reverse order, a bucket closes once it holds its cap.
        self.buckets: list[list[int]] = []  # parameter indices per bucket
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, offset)
        sizes: list[int] = []
        current: list[int] = []
        size = 0
        for i in reversed(range(len(self.params))):
            n = self.params[i].numel()
            current.append(i)
            size += n
            if size >= caps[min(len(self.buckets), 1)]:
                self.buckets.append(current)
                sizes.append(size)
                current, size = [], 0
        if current or not self.buckets:
            self.buckets.append(current)
            sizes.append(size)
        for b, idx in enumerate(self.buckets):
            at = 0
            for i in idx:
                self._where[id(self.params[i])] = (b, at)
                at += self.params[i].numel()
        self.sizes = sizes
        self._counts = tuple(len(idx) for idx in self.buckets)  # parameters per bucket
        self._last_params = [self.params[i] for i in self.buckets[-1]]  # filled by ``launch_rest``
        self.tail_len = 0
        self._bufs: Optional[list[torch.Tensor]] = None
        self._launch: Optional[Callable[[torch.Tensor], object]] = None
        self._pending: list[int] = []
        self._filled: set[int] = set()
        self._next = 0  # the next bucket to launch (in order)
        self._works: list = []
        self.failure: Optional[BaseException] = None
        self.armed = False
        self.release = release
        self.released = False  # a gradient of the armed (or last) step was dropped into its bucket
        self._views: Optional[list] = None  # (param, its slice of a bucket), per buffer allocation
        self._last_views: list = []  # the last bucket's slices, in its parameters' order
        self._tail: Optional[torch.Tensor] = None
        self._tail_words = None
        self._pairs: dict = {}
        # The last bucket is filled and launched by ``launch_rest``: its parameters need no hook
        # (unless their gradients are to be released as they come).
        last = set() if release else set(self.buckets[-1])
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_ready)
                       for i, p in enumerate(self.params) if i not in last]

    def __len__(self) -> int:
        return len(self.buckets)

    # ---------------------------------------------------------------- buffers
    def _buffers(self) -> list[torch.Tensor]:
        if self._bufs is None:
            p0 = self.params[0] if self.params else None
            kw = {"dtype": p0.dtype if p0 is not None else torch.float32,
                  "device": p0.device if p0 is not None else torch.device("cpu")}
            n = len(self.sizes)
            self._bufs = [torch.empty(s + (self.tail_len if b == n - 1 else 0), **kw)
                          for b, s in enumerate(self.sizes)]
            self._views = []
            for b, idx in enumerate(self.buckets):
                at = 0
                for i in idx:
                    p = self.params[i]
                    self._views.append((p, self._bufs[b][at:at + p.numel()].view_as(p)))
                    at += p.numel()
            last = self._bufs[-1]
            self._last_views = [v for _, v in self._views[len(self._views) - len(self.buckets[-1]):]]
            self._tail = last[last.numel() - self.tail_len:]
            # The tail's numbers written and read on the host without a torch op (CPU, a dtype
            # numpy has); None elsewhere.
            self._tail_words = (self._tail.numpy() if self._tail.device.type == "cpu"
                                and self._tail.dtype in (torch.float32, torch.float64) else None)
            self._pairs = {}
        return self._bufs

    def set_tail(self, n: int) -> None:
        """Reserve ``n`` elements after the last bucket's gradients for the step's control numbers."""
        if n != self.tail_len:
            self.tail_len = n
            self._bufs = self._views = None

    def drop_buffers(self) -> None:
        """Forget the buffers: an op abandoned after a failure may still write into them (gloo
        keeps its tensors alive), so the next step reduces fresh ones."""
        self._bufs = self._views = None

    def tail(self) -> torch.Tensor:
        """The last bucket's control elements (write before ``finish``, read after it)."""
        self._buffers()
        return self._tail

    def tail_words(self):
        """``tail()`` as a numpy array sharing its memory (gradients on the CPU in float32 or
        float64), or None: the step's host numbers written and read without torch ops."""
        self._buffers()
        return self._tail_words

    def tail_pair(self, at: int) -> torch.Tensor:
        """A 2-element view of the tail: its element 0 and element ``at`` (one op writes both)."""
        self._buffers()
        view = self._pairs.get(at)
        if view is None:
            t = self._tail
            view = self._pairs[at] = t.as_strided((2,), (at,), t.storage_offset())
        return view

    # ---------------------------------------------------------------- the step
    def arm(self, launch: Callable[[torch.Tensor], object], world: int = 1) -> None:
        """The next backward is this member's last of the step: reduce as gradients become final.
        ``launch(buffer) -> work`` starts one bucket's all-reduce on the generation's group;
        ``world``: its members (a compressed bucket is divided by it before the reduction)."""
        if self.armed:
            return
        self._buffers()
        self._launch = launch
        self._world = max(1, int(world))
        self._pending = list(self._counts)
        self._filled = set()
        self._next, self._works, self.failure = 0, [], None
        self._coded = []
        self.released = False
        self.armed = True

    def disarm(self) -> None:
        """Forget a step that is not reduced (a failure, a discarded step); buckets already
        launched leave their buffers to the abandoned ops (``drop_buffers``)."""
        if self._works:
            self.drop_buffers()
        self.armed = False
        self._launch, self._works, self._coded = None, [], []

    def _on_ready(self, p: torch.nn.Parameter) -> None:
        if not self.armed or self.failure is not None:
            return
        key = id(p)
        if key in self._filled:
            self.failure = RuntimeError(
                "a parameter's gradient was produced twice in the step's final backward (backward "
                "called again after the gradients were handed to the reduction); accumulate in "
                "earlier micro-batches, as under DDP")
            return
        b, at = self._where[key]
        self._bufs[b][at:at + p.numel()].copy_(p.grad.reshape(-1))
        if self.release:
            p.grad = None
            self.released = True
        self._filled.add(key)
        self._pending[b] -= 1
        # Launch in order; the last bucket waits for ``launch_rest`` (it carries the tail).
        while self._next < len(self.buckets) - 1 and self._pending[self._next] == 0:
            self._start(self._next)

    def _start(self, b: int) -> None:
        buf = self._bufs[b]
        sends = [buf]
        if self.compress is not None and buf.dtype != self.compress:
            tail = self.tail_len if b == len(self.buckets) - 1 else 0
            grads = buf[:buf.numel() - tail]
            coded = grads.to(self.compress).div_(self._world)  # DDP's compression hooks: x / N, cast
            self._coded.append((grads, coded))
            sends = [coded, buf[buf.numel() - tail:]] if tail else [coded]
        try:
            for t in sends:
                self._works.append(self._launch(t))
        except Exception as exc:  # a CollectiveFailure: raised by ``launch_rest``, not in backward()
            self.failure = exc
        self._next = b + 1

    def finish(self, wait: Callable[[object], None]) -> list[torch.Tensor]:
        """``launch_rest`` then ``wait_all`` (disarmed however it ends)."""
        try:
            self.launch_rest()
        except BaseException:
            self.disarm()
            raise
        return self.wait_all(wait)

    def launch_rest(self) -> None:
        """Fill what the final backward did not produce and launch the buckets left (the last
        with its tail, which the caller wrote).  Raises what a launch raised (the caller
        recovers and ``disarm``s; ``.grad`` is untouched)."""
        if not self.armed:
            raise RuntimeError("launch_rest() without arm()")
        last = len(self.buckets) - 1
        if self.failure is None:
            # The hooked buckets (with ``release`` the last one too): parameters no gradient
            # reached in the final backward.
            for b in range(last + 1 if self.release else last):
                if self._pending[b]:
                    for i in self.buckets[b]:
                        p = self.params[i]
                        if id(p) not in self._filled:
                            at = self._where[id(p)][1]
                            self._fill(self._bufs[b][at:at + p.numel()], p)
        if self.failure is None and not self.release:
            # The last bucket in one op (its gradients are final once backward returned).
            grads = [p.grad for p in self._last_params]
            dtype = self._bufs[last].dtype
            if grads and all(g is not None and g.dtype == dtype for g in grads):
                foreach_copy(self._last_views, grads)
            else:  # a parameter without a gradient (reduced as zeros), or another dtype
                for g, v in zip(grads, self._last_views):
                    if g is None:
                        v.zero_()
                    else:
                        v.copy_(g)
        while self.failure is None and self._next < len(self.buckets):
            self._start(self._next)
        if self.failure is not None:
            raise self.failure

    def wait_all(self, wait: Callable[[object], None]) -> list[torch.Tensor]:
        """``wait(work)`` for every launched bucket in order; the reduced buffers.  The buckets
        are disarmed however it ends (a failure leaves the buffers to the abandoned ops)."""
        try:
            for work in self._works:
                wait(work)
            self._works = []  # all done: the buffers stay ours
            for grads, coded in self._coded:  # back to the gradients' dtype, the sum again
                grads.copy_(coded).mul_(self._world)
            return self._bufs
        finally:
            self.disarm()

    @staticmethod
    def _fill(view: torch.Tensor, p: torch.nn.Parameter) -> None:
        if p.grad is None:
            view.zero_()  # unused in this step's forward: reduced as zeros
        else:
            view.copy_(p.grad.reshape(-1))

    def divide(self, denom) -> None:
        """Divide the reduced gradients (not the tail) by ``denom`` (a number or a 1-element
        tensor on their device): a token-weighted step's global token count."""
        for i, buf in enumerate(self._bufs):
            n = buf.numel() - (self.tail_len if i == len(self._bufs) - 1 else 0)
            buf[:n].div_(denom)

    def assign_grads(self) -> None:
        """Point every parameter's ``.grad`` at its reduced slice (after ``finish``)."""
        for p, view in self._views:
            p.grad = view

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
