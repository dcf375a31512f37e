"""The tcp backend's connections and I/O loop: links, handshakes, the mesh, a group's setup through its
store, and the transport that carries frames over a group's links."""
