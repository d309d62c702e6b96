package kernels

import "reflect"

var bufferType = reflect.TypeFor[*Buffer]()

// AppendBuffers appends to out every *Buffer reachable from args through
// exported struct fields, pointers to structs, arrays and slices (an op's
// argument struct and the NVFP4, Operand, Scatter and KVCache values it
// nests), each once: seen records the buffers already listed and may be
// shared across calls. Backends use it to check ownership and to list a
// captured graph's buffers.
func AppendBuffers(out []*Buffer, seen map[*Buffer]bool, args any) []*Buffer {
	if args == nil {
		return out
	}
	return appendBuffers(out, seen, reflect.ValueOf(args))
}

func appendBuffers(out []*Buffer, seen map[*Buffer]bool, v reflect.Value) []*Buffer {
	switch {
	case v.Type() == bufferType:
		if b := v.Interface().(*Buffer); b != nil && !seen[b] {
			seen[b] = true
			out = append(out, b)
		}
	case v.Kind() == reflect.Struct:
		for i := range v.NumField() {
			if v.Type().Field(i).IsExported() {
				out = appendBuffers(out, seen, v.Field(i))
			}
		}
	case v.Kind() == reflect.Pointer && !v.IsNil() && v.Elem().Kind() == reflect.Struct: // optional operands (GroupedGemmArgs.Scatter)
		out = appendBuffers(out, seen, v.Elem())
	case v.Kind() == reflect.Slice || v.Kind() == reflect.Array:
		for i := range v.Len() {
			out = appendBuffers(out, seen, v.Index(i))
		}
	}
	return out
}
