"""The tcp backend's algorithms: collectives over sockets, the hierarchy across hosts,
point-to-point, and the lanes operations run in."""
