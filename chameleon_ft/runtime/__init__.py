"""torch.distributed runtime: membership, process groups, elastic sampler, state transfer, fault injection."""
