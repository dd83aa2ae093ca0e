"""The relay: workers behind NAT register outbound connections under a name; backbones reach them through it."""
