"""Everything inside one jitted step: batch packing, the decoder and encoder runners, the
sampler, the incremental pooler, the packed device->host layout and the executable cache."""
