"""The torch backend: reference ops and attention in plain torch, the fallback of every other backend."""
