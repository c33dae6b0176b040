"""What servers and clients share on the wire: channels, TLS and tokens, the registry, the handshake."""
