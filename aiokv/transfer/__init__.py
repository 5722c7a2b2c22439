"""Transfer executor: ordered copy streams (CPU worker threads, CUDA streams) and TransferFuture."""
