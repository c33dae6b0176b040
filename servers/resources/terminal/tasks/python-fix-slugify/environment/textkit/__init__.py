from .slug import slugify

__all__ = ["slugify"]
