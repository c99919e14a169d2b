"""Chapter 03: not written yet (see the course map in README.md)."""
