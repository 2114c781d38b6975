"""bufreuse.launch"""

__all__: list[str] = []
