"""Turn titles into URL slugs."""


def slugify(text: str) -> str:
    """Lower-case ASCII words of ``text`` joined by single hyphens (accents folded)."""
    raise NotImplementedError
