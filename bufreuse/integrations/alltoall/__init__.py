"""The alltoall dispatch path: its layer hooks (``hooks``) and the helpers they own."""
