"""bufreuse.analysis"""

__all__: list[str] = []
