"""Speed, measured as ratios within one run (`kvq bench`): `timing` (clocks and the device's copy rate), `kernels`
(the fused quantize and decode-attention kernels), `decode` (end-to-end ms/token per cache and loop) and `tables`
(what they print). Decoding itself is kvq.generate's; the caches are kvq.cache's and kvq.static_cache's."""
