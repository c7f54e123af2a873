"""Per-kernel sweeps against PyTorch and peer libraries; results under results/<device>/."""
