"""bufreuse.bench"""

__all__: list[str] = []
