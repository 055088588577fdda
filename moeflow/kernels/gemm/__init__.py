"""The grouped GEMMs of the experts stage (gate_up with the activation, down with the routing weight)."""
