"""torch.distributed runtime: membership, process groups, elastic sampler, state transfer, fault injection."""

from chameleon_ft.runtime.errors import install_excepthook

install_excepthook()  # a no-op unless this process was started by ``chameleon-ft run``
