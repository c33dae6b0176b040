from .ranges import parse_ranges

__all__ = ["parse_ranges"]
