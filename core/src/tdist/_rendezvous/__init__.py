"""The built-in init methods (``env://``, ``tcp://``, ``file://``), registered through
the same entry point and hook as any third-party rendezvous plugin."""
