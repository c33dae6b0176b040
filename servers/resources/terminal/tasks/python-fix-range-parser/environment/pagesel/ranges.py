def parse_ranges(spec):
    """Parse a page selection such as "1-3,5,9-10" into a list of page numbers.

    Items are separated by commas; each item is a page "N" or an inclusive
    range "A-B" with A <= B. Spaces around numbers are ignored. The result is
    sorted and has no duplicates. Raises ValueError on a malformed item, a
    page below 1, or a range with A > B.
    """
    pages = set()
    for item in spec.split(","):
        item = item.strip()
        if "-" in item:
            start_s, end_s = item.split("-", 1)
            start, end = int(start_s), int(end_s)
            if start < 1 or start > end:
                raise ValueError(f"bad range: {item!r}")
            pages.update(range(start, end))
        else:
            page = int(item)
            if page < 1:
                raise ValueError(f"bad page: {item!r}")
            pages.add(page)
    return sorted(pages)
