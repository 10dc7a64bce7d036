"""Mosaic TPU variants: tile -> slot ids are scalar-prefetched and the weight BlockSpecs' index_maps
pick the slot, so each grid step sees only its slot's [d, r] blocks in VMEM."""
