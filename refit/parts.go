package refit

import (
	"fmt"
	"io"
	"slices"
	"sort"
)

// partSource is one part of a version (PROTOCOL.md, "Parts"): a
// safetensors stream of some of the version stream's tensors, their bytes
// read from the version stream when asked for.
type partSource struct {
	head    []byte
	segs    []partSeg // in stream order
	size    int64
	tensors int
	src     io.ReaderAt
}

// partSeg is a tensor of a part: its bytes at stream in the part, at src
// in the version stream.
type partSeg struct {
	stream, src, n int64
}

// splitParts splits the version stream src (header h) into at most n
// parts of consecutive tensors (in data order) of about equal bytes, each
// holding one tensor at least. It returns nil when that leaves one part.
func splitParts(src io.ReaderAt, h Header, n int) ([]*partSource, error) {
	ts := slices.Clone(h.Tensors)
	slices.SortFunc(ts, func(a, b TensorInfo) int { return int(a.Begin - b.Begin) })
	n = min(n, len(ts))
	if n < 2 {
		return nil, nil
	}
	var data int64
	for _, t := range ts {
		data += t.End - t.Begin
	}
	var parts []*partSource
	var entries []headerOut
	var spans []TensorInfo
	var done int64
	flush := func() error {
		ps := &partSource{src: src, tensors: len(entries)}
		head, err := versionHeader(entries)
		if err != nil {
			return err
		}
		ps.head, ps.size = head, int64(len(head))
		for _, t := range spans {
			ps.segs = append(ps.segs, partSeg{stream: ps.size, src: h.DataStart() + t.Begin, n: t.End - t.Begin})
			ps.size += t.End - t.Begin
		}
		parts = append(parts, ps)
		entries, spans = entries[:0], spans[:0]
		return nil
	}
	for i, t := range ts {
		shape := make([]uint64, len(t.Shape))
		for j, d := range t.Shape {
			shape[j] = uint64(d)
		}
		entries = append(entries, headerOut{name: t.Name, dtype: t.DType, shape: shape, size: t.End - t.Begin})
		spans = append(spans, t)
		done += t.End - t.Begin
		left := len(ts) - i - 1 // tensors for the parts after this one
		k := len(parts)         // this part
		// Close the part once it holds its share, or when the parts after
		// it need every tensor left.
		if k < n-1 && (done*int64(n) >= data*int64(k+1) || left == n-1-k) {
			if err := flush(); err != nil {
				return nil, err
			}
		}
	}
	if err := flush(); err != nil {
		return nil, err
	}
	return parts, nil
}

// ReadAt reads the part's bytes at off: its header from memory, tensor
// bytes from the version stream.
func (ps *partSource) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("refit: part: read at negative offset %d", off)
	}
	n := 0
	if off < int64(len(ps.head)) {
		n = copy(p, ps.head[off:])
	}
	i := sort.Search(len(ps.segs), func(i int) bool { return ps.segs[i].stream+ps.segs[i].n > off+int64(n) })
	for ; i < len(ps.segs) && n < len(p); i++ {
		sg := ps.segs[i]
		at := off + int64(n) - sg.stream
		m := int(min(int64(len(p)-n), sg.n-at))
		if err := readFull(ps.src, p[n:n+m], sg.src+at); err != nil {
			return n, err
		}
		n += m
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// AutoPartBytes is the payload AutoParts gives each part: a part moves at
// about half a GB/s, so a version of tens of GB needs more than one, and a
// version of less than this goes in one.
const AutoPartBytes = 2 << 30

// AutoParts is the part count for a version of size bytes published from a
// machine of cpus cores over 1 + servers servers (PublisherConfig.Parts
// and PartServers): one part a AutoPartBytes, at most one a four cores,
// at least one a server, at most MaxParts. The cores bound it because a
// part keeps cores busy at every hop: on a 16-core host carrying the
// publisher, four servers and the worker, a 61 GB version took 33.0 s in
// four parts and 39.5 s in eight (docs/REFIT.md).
func AutoParts(size int64, cpus, servers int) int {
	n := int(min((size+AutoPartBytes-1)/AutoPartBytes, MaxParts))
	n = min(max(n, 1), max(cpus/4, 1))
	return min(max(n, 1+servers), MaxParts)
}
