"""The hook tree at run time: torch hooks that fire the canonical HookPoints, hooked attention, and the values the driver computes itself."""
