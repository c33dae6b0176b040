import re


def slugify(text):
    """Turn ``text`` into a URL slug.

    The text is lower-cased; every run of one or more characters that are not
    ASCII letters or digits becomes a single "-"; the result never starts or
    ends with "-". An input with no letters or digits gives "".
    """
    return re.sub(r"[^a-z0-9]", "-", text.lower())
