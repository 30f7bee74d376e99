"""SGLang 0.5.23 served on this CPU as a user runs it: stand-ins, a tiny model, servers."""
