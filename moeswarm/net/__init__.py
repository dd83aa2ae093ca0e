"""Peer-to-peer networking: discovery of workers, relays for workers behind NAT, and path choice."""
