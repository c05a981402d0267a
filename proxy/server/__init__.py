"""The HTTP front door: the Starlette app and the three API surfaces it serves."""
