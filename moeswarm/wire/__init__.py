"""Wire protocol v2: framed binary messages over persistent TCP. See docs/protocol.md."""
