// A writer and reader of direct-volume records built only from what Kata's
// Go package (src/runtime/pkg/direct-volume) uses: encoding/json with its
// struct tags, base64.URLEncoding, os.MkdirAll(0700), os.WriteFile(0600),
// and its sandbox-id lookup. The tests use it so that records reach crustd
// byte for byte as a CSI driver linking that package files them, written by
// Go's own encoders rather than crustd's.
//
//	kata_writer add ROOT VOLUME_PATH DEVICE FSTYPE [KEY=VALUE...] [-o OPTION...]
//	kata_writer add-raw ROOT VOLUME_PATH JSON
//	kata_writer sandbox ROOT VOLUME_PATH      (prints the sandbox id, as GetSandboxIDForVolume)
//	kata_writer remove ROOT VOLUME_PATH
package main

import (
	b64 "encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

const mountInfoFileName = "mountInfo.json"

type MountInfo struct {
	VolumeType string            `json:"volume-type"`
	Device     string            `json:"device"`
	FsType     string            `json:"fstype"`
	Metadata   map[string]string `json:"metadata,omitempty"`
	Options    []string          `json:"options,omitempty"`
}

func dir(root, volumePath string) string {
	return filepath.Join(root, b64.URLEncoding.EncodeToString([]byte(volumePath)))
}

func add(root, volumePath, mountInfo string) error {
	volumeDir := dir(root, volumePath)
	stat, err := os.Stat(volumeDir)
	if err != nil {
		if !os.IsNotExist(err) {
			return err
		}
		if err := os.MkdirAll(volumeDir, 0700); err != nil {
			return err
		}
	}
	if stat != nil && !stat.IsDir() {
		return fmt.Errorf("%s should be a directory", volumeDir)
	}
	var deserialized MountInfo
	if err := json.Unmarshal([]byte(mountInfo), &deserialized); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(volumeDir, mountInfoFileName), []byte(mountInfo), 0600)
}

func sandbox(root, volumePath string) (string, error) {
	files, err := os.ReadDir(dir(root, volumePath))
	if err != nil {
		return "", err
	}
	for _, f := range files {
		if f.Name() != mountInfoFileName {
			return f.Name(), nil
		}
	}
	return "", fmt.Errorf("no sandbox found for %s", volumePath)
}

func main() {
	a := os.Args
	var err error
	switch {
	case len(a) >= 6 && a[1] == "add":
		mi := MountInfo{VolumeType: "directvol", Device: a[4], FsType: a[5]}
		for i := 6; i < len(a); i++ {
			if a[i] == "-o" && i+1 < len(a) {
				mi.Options = append(mi.Options, a[i+1])
				i++
			} else if k, v, ok := strings.Cut(a[i], "="); ok {
				if k == "volume-type" {
					mi.VolumeType = v
					continue
				}
				if mi.Metadata == nil {
					mi.Metadata = map[string]string{}
				}
				mi.Metadata[k] = v
			}
		}
		var s []byte
		if s, err = json.Marshal(&mi); err == nil {
			err = add(a[2], a[3], string(s))
		}
	case len(a) == 5 && a[1] == "add-raw":
		err = add(a[2], a[3], a[4])
	case len(a) == 4 && a[1] == "sandbox":
		var id string
		if id, err = sandbox(a[2], a[3]); err == nil {
			fmt.Println(id)
		}
	case len(a) == 4 && a[1] == "remove":
		err = os.RemoveAll(dir(a[2], a[3]))
	default:
		err = fmt.Errorf("usage: kata_writer add|add-raw|sandbox|remove ROOT VOLUME_PATH ...")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
