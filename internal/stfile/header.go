package stfile

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"sort"
)

// entry is one tensor of a parsed header: its type, shape and byte range
// in the data section.
type entry struct {
	dtype  DType
	shape  []uint64
	lo, hi uint64
}

// parsedHeader is a parsed and checked safetensors header.
type parsedHeader struct {
	metadata map[string]string // never nil
	entries  map[string]entry
	names    []string // sorted
}

// parseHeader parses the JSON header of a file whose data section holds
// dataLen bytes and checks it as the safetensors format requires: every
// tensor has a known dtype, a shape and two data offsets; its byte count
// is its element count times the dtype's size; and the tensors' ranges,
// in offset order, tile the data section exactly. It parses the header
// itself rather than through github.com/nlpodyssey/safetensors so that
// files holding F8_E4M3 or F8_E5M2 tensors (NVFP4 and FP8 checkpoints'
// scales) can be read; the checks are the library's.
func parseHeader(head []byte, dataLen uint64) (*parsedHeader, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(head, &raw); err != nil {
		return nil, fmt.Errorf("invalid header deserialization: %v", err)
	}
	h := &parsedHeader{metadata: map[string]string{}, entries: make(map[string]entry, len(raw))}
	for name, v := range raw {
		if name == metadataKey {
			var md map[string]string
			if err := json.Unmarshal(v, &md); err != nil {
				return nil, fmt.Errorf("%s: %v", metadataKey, err)
			}
			if md != nil {
				h.metadata = md
			}
			continue
		}
		var t struct {
			DType       *string   `json:"dtype"`
			Shape       *[]uint64 `json:"shape"`
			DataOffsets *[]uint64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(v, &t); err != nil {
			return nil, fmt.Errorf("tensor %q: %v", name, err)
		}
		switch {
		case t.DType == nil || t.Shape == nil || t.DataOffsets == nil:
			return nil, fmt.Errorf("tensor %q: want dtype, shape and data_offsets", name)
		case len(*t.DataOffsets) != 2:
			return nil, fmt.Errorf("tensor %q: data_offsets %v, want two", name, *t.DataOffsets)
		}
		dt, err := ParseDType(*t.DType)
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %v", name, err)
		}
		e := entry{dtype: dt, shape: *t.Shape, lo: (*t.DataOffsets)[0], hi: (*t.DataOffsets)[1]}
		if e.shape == nil {
			e.shape = []uint64{}
		}
		if e.lo > e.hi || e.hi > dataLen {
			return nil, fmt.Errorf("tensor %q: data offsets [%d, %d) outside the %d data bytes", name, e.lo, e.hi, dataLen)
		}
		if err := (Tensor{DType: dt, Shape: e.shape}).checkLen(int(e.hi - e.lo)); err != nil {
			return nil, fmt.Errorf("tensor %q: %v", name, err)
		}
		h.entries[name] = e
	}
	h.names = slices.Sorted(maps.Keys(h.entries))
	byOffset := slices.Clone(h.names)
	sort.SliceStable(byOffset, func(i, j int) bool {
		a, b := h.entries[byOffset[i]], h.entries[byOffset[j]]
		return a.lo < b.lo || a.lo == b.lo && a.hi < b.hi
	})
	var at uint64
	for _, name := range byOffset {
		e := h.entries[name]
		if e.lo != at {
			return nil, fmt.Errorf("tensor %q: data starts at %d, want %d", name, e.lo, at)
		}
		at = e.hi
	}
	if at != dataLen {
		return nil, fmt.Errorf("tensors cover %d of the %d data bytes", at, dataLen)
	}
	return h, nil
}
