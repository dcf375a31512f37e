"""The tcp backend's wire and auth layer: frame format and codes, the authenticated handshake, TLS."""
