"""The pure core: data in, data out. No sockets, no store, no clock-driven waits;
nothing here imports an I/O library (tests/test_layering.py)."""
