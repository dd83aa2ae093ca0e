"""Wire protocol v1: framed binary messages over persistent TCP. See docs/protocol.md."""
