"""ddiloco-geo: Decoupled DiLoCo (arXiv 2604.21428) over object storage."""

__version__ = "0.1.0"
