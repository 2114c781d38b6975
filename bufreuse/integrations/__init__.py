"""bufreuse.integrations"""

__all__: list[str] = []
