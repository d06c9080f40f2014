//! Writing generated clips as video files: H.264 in MP4, animated GIF, and lossless animated
//! WebP. Everything is encoded in-process by Rust crates (OpenH264 is compiled from the source
//! its crate bundles), so neither the CLI nor the server needs ffmpeg or a system codec
//! library. MP4 carries BT.601 limited-range 4:2:0 and needs even sizes; GIF quantises each
//! frame to its own 256-colour palette; WebP is exact. All three loop or play at the clip's
//! frame rate and hold exactly the clip's frames.

use std::path::Path;

use image_webp::{ColorType, WebPEncoder};
use openh264::encoder::{
    BitRate, Encoder, EncoderConfig, FrameRate, IntraFramePeriod, QpRange, RateControlMode,
    VuiConfig,
};
use openh264::formats::{RgbSliceU8, YUVBuffer};
use openh264::OpenH264API;

use crate::{Error, Result};

/// Frames of one clip, shown `fps` a second: each is `width × height` interleaved 8-bit
/// RGB, row-major.
#[derive(Debug, Clone)]
pub struct Clip<'a> {
    pub width: usize,
    pub height: usize,
    pub fps: f64,
    pub frames: Vec<&'a [u8]>,
}

/// A file format a clip can be written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VideoFormat {
    Mp4,
    Gif,
    Webp,
}

impl VideoFormat {
    /// The format a file name asks for, by its extension in any case.
    pub fn from_path(path: &Path) -> Option<VideoFormat> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "mp4" => Some(VideoFormat::Mp4),
            "gif" => Some(VideoFormat::Gif),
            "webp" => Some(VideoFormat::Webp),
            _ => None,
        }
    }
}

/// Frames [F, 3, H, W] in [-1, 1] as 8-bit interleaved RGB, rounded as diffusers'
/// postprocessing rounds: one buffer per frame.
pub fn rgb8(frames: &candle_core::Tensor) -> Result<Vec<Vec<u8>>> {
    (0..frames.dim(0)?)
        .map(|i| -> Result<Vec<u8>> {
            let f = ((frames.get(i)?.permute((1, 2, 0))? + 1.0)? * 127.5)?
                .clamp(0f32, 255f32)?
                .round()?
                .flatten_all()?
                .to_vec1::<f32>()?;
            Ok(f.into_iter().map(|x| x as u8).collect())
        })
        .collect()
}

/// The bytes of a file holding `clip` in `format`.
pub fn encode(clip: &Clip, format: VideoFormat) -> Result<Vec<u8>> {
    check(clip)?;
    match format {
        VideoFormat::Mp4 => mp4(clip),
        VideoFormat::Gif => gif(clip),
        VideoFormat::Webp => webp(clip),
    }
}

/// Writes `clip` to `path` in the format its extension names.
pub fn write(path: &Path, clip: &Clip) -> Result<()> {
    let format = VideoFormat::from_path(path).ok_or_else(|| {
        let msg = format!("{}: not .mp4, .gif or .webp", path.display());
        Error::invalid("video path", msg)
    })?;
    let bytes = encode(clip, format)?;
    std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
}

fn check(clip: &Clip) -> Result<()> {
    if clip.width == 0 || clip.height == 0 {
        let msg = format!("{}×{} has no pixels", clip.width, clip.height);
        return Err(Error::invalid("clip size", msg));
    }
    // The bounds keep every container's time fields (u16 centiseconds, 24-bit milliseconds,
    // u32 ticks) in range without special cases.
    if !(0.1..=1000.0).contains(&clip.fps) {
        let msg = format!("{} is outside 0.1..=1000 frames per second", clip.fps);
        return Err(Error::invalid("clip.fps", msg));
    }
    if clip.frames.is_empty() {
        return Err(Error::invalid("clip.frames", "a video needs a frame"));
    }
    let (w, h) = (clip.width, clip.height);
    let want = w.checked_mul(h).and_then(|n| n.checked_mul(3));
    for (i, frame) in clip.frames.iter().enumerate() {
        if Some(frame.len()) != want {
            let msg = format!("{} bytes, not the {w}×{h}×3 of RGB", frame.len());
            return Err(Error::invalid(format!("clip.frames[{i}]"), msg));
        }
    }
    Ok(())
}

/// Frame `i`'s display time in `1/unit` seconds, rounded on the running total so that long
/// clips keep in step with the frame rate instead of drifting by each frame's rounding.
fn duration(i: usize, fps: f64, unit: f64) -> f64 {
    let at = |k: usize| (k as f64 * unit / fps).round();
    at(i + 1) - at(i)
}

// ---- MP4 ----------------------------------------------------------------------------------

/// The finest quantiser OpenH264 may use (lower is finer). 20 keeps the texture of generated
/// frames; the bit-rate target below is so high that rate control stays at this floor.
const MP4_QP: u8 = 20;
/// Ticks per frame; the timescale is `fps × 1000`, so a rate given to a thousandth of a
/// frame per second (23.976, 29.97) is exact.
const MP4_TICKS: u32 = 1000;

fn mp4(clip: &Clip) -> Result<Vec<u8>> {
    let (w, h, n) = (clip.width, clip.height, clip.frames.len());
    if w % 2 == 1 || h % 2 == 1 {
        // Padding would change the picture's size behind the caller's back; the engine's
        // sizes are multiples of 16 anyway.
        let msg = format!("{w}×{h}: H.264 4:2:0 needs even sides (GIF and WebP take any)");
        return Err(Error::invalid("clip size", msg));
    }
    if n > (u32::MAX / MP4_TICKS) as usize {
        let msg = format!("{n} are too many for one MP4 track");
        return Err(Error::invalid("clip.frames", msg));
    }
    let track = h264(clip)?;
    let mut out = Vec::with_capacity(track.mdat.len() + 4096);
    let brands = b"isom\0\0\x02\0isomiso2avc1mp41";
    bx(&mut out, b"ftyp", |o| o.extend(brands));
    // The 64-bit form of mdat's size only for the rare file over 4 GiB.
    let len = track.mdat.len() as u64;
    let head = match u32::try_from(len + 8) {
        Ok(size) => [&size.to_be_bytes()[..], b"mdat"].concat(),
        Err(_) => [&1u32.to_be_bytes()[..], b"mdat", &(len + 16).to_be_bytes()].concat(),
    };
    // moov goes first so that a browser can play while the rest arrives. Its length does not
    // depend on the chunk offset it holds, so a first pass measures it.
    let offset = out.len() + track.moov(clip, 0).len() + head.len();
    let offset = u32::try_from(offset).map_err(|_| Error::bug("an MP4 index over 4 GiB"))?;
    out.extend(track.moov(clip, offset));
    out.extend(head);
    out.extend(&track.mdat);
    Ok(out)
}

fn h264(clip: &Clip) -> Result<Track> {
    let (w, h) = (clip.width, clip.height);
    let err = |e: openh264::Error| Error::internal("the H.264 encoder failed", e);
    let bits_per_second = (w * h) as f64 * clip.fps * 4.0;
    let config = EncoderConfig::new()
        .max_frame_rate(FrameRate::from_hz(clip.fps as f32))
        .rate_control_mode(RateControlMode::Quality)
        .bitrate(BitRate::from_bps(bits_per_second.clamp(1e6, 2e8) as u32))
        .qp(QpRange::new(MP4_QP, 51))
        // A skipped frame would leave the file a frame short. (OpenH264 warns on stderr that
        // it then cannot hold the bit rate, which is not wanted anyway.)
        .skip_frames(false)
        // A keyframe every two seconds, so players can seek.
        .intra_frame_period(IntraFramePeriod::from_num_frames((clip.fps * 2.0) as u32))
        .vui(VuiConfig::bt601());
    let mut encoder = Encoder::with_api_config(OpenH264API::from_source(), config).map_err(err)?;
    // OpenH264's own conversion: BT.601 limited range, chroma from each 2×2 block's mean.
    let mut yuv = YUVBuffer::new(w, h);
    let mut track = Track::default();
    for (i, rgb) in clip.frames.iter().enumerate() {
        yuv.read_rgb8(RgbSliceU8::new(rgb, (w, h)));
        let stream = encoder.encode(&yuv).map_err(err)?;
        let (start, mut picture, mut idr) = (track.mdat.len(), false, false);
        for layer in (0..stream.num_layers()).filter_map(|l| stream.layer(l)) {
            for nal in (0..layer.nal_count()).filter_map(|k| layer.nal_unit(k)) {
                let nal = nal.strip_prefix(&[0, 0, 0, 1]).unwrap_or(nal);
                // Parameter sets belong in avcC for an `avc1` track, not in the samples.
                match nal.first().map(|b| b & 0x1f) {
                    Some(7) => track.sps = nal.to_vec(),
                    Some(8) => track.pps = nal.to_vec(),
                    Some(9) | None => {}
                    Some(kind) => {
                        picture |= kind == 1 || kind == 5;
                        idr |= kind == 5;
                        track.mdat.extend((nal.len() as u32).to_be_bytes());
                        track.mdat.extend(nal);
                    }
                }
            }
        }
        if !picture || track.sps.len() < 4 || track.pps.is_empty() {
            let msg = format!("the H.264 encoder gave no picture for frame {i}");
            return Err(Error::bug(msg));
        }
        track.sizes.push((track.mdat.len() - start) as u32);
        if idr {
            track.sync.push(i as u32 + 1);
        }
    }
    Ok(track)
}

/// One clip's H.264 samples, laid out for an MP4 track whose samples form a single chunk.
#[derive(Default)]
struct Track {
    sps: Vec<u8>,
    pps: Vec<u8>,
    mdat: Vec<u8>,
    sizes: Vec<u32>,
    sync: Vec<u32>,
}

impl Track {
    fn moov(&self, clip: &Clip, chunk_offset: u32) -> Vec<u8> {
        const MATRIX: [u32; 9] = [0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x4000_0000];
        // Version and flags, pre-defined, handler type, reserved, and an empty name.
        const HDLR: &[u8] = b"\0\0\0\0\0\0\0\0vide\0\0\0\0\0\0\0\0\0\0\0\0\0";
        let und = 0x55c4 << 16; // ISO 639 "und", packed
        let scale = (clip.fps * f64::from(MP4_TICKS)).round() as u32;
        let length = self.sizes.len() as u32 * MP4_TICKS;
        let (w, h) = (clip.width as u32, clip.height as u32);
        let mut o = Vec::new();
        bx(&mut o, b"moov", |o| {
            bx(o, b"mvhd", |o| {
                words(o, &[0, 0, 0, scale, length, 0x10000, 0x0100_0000, 0, 0]);
                words(o, &MATRIX);
                words(o, &[0, 0, 0, 0, 0, 0, 2]);
            });
            bx(o, b"trak", |o| {
                bx(o, b"tkhd", |o| {
                    words(o, &[3, 0, 0, 1, 0, length, 0, 0, 0, 0]);
                    words(o, &MATRIX);
                    words(o, &[w << 16, h << 16]);
                });
                bx(o, b"mdia", |o| {
                    bx(o, b"mdhd", |o| words(o, &[0, 0, 0, scale, length, und]));
                    bx(o, b"hdlr", |o| o.extend(HDLR));
                    bx(o, b"minf", |o| {
                        bx(o, b"vmhd", |o| words(o, &[1, 0, 0]));
                        bx(o, b"dinf", |o| {
                            bx(o, b"dref", |o| {
                                words(o, &[0, 1]);
                                bx(o, b"url ", |o| words(o, &[1]));
                            })
                        });
                        bx(o, b"stbl", |o| self.stbl(o, w << 16 | h, chunk_offset));
                    });
                });
            });
        });
        o
    }

    fn stbl(&self, o: &mut Vec<u8>, size: u32, chunk_offset: u32) {
        let (count, sps, pps) = (self.sizes.len() as u32, &self.sps, &self.pps);
        let stss = [&[0, self.sync.len() as u32], &self.sync[..]].concat();
        let stsz = [&[0, 0, count], &self.sizes[..]].concat();
        bx(o, b"stsd", |o| {
            words(o, &[0, 1]);
            bx(o, b"avc1", |o| {
                words(o, &[0, 1, 0, 0, 0, 0, size, 0x0048_0000, 0x0048_0000, 0]);
                o.extend([0, 1].iter().chain(&[0; 32]).chain(&[0, 0x18, 0xff, 0xff]));
                bx(o, b"avcC", |o| {
                    // Version, profile, compatibility, level, 4-byte NAL lengths, one SPS.
                    o.extend([1, sps[1], sps[2], sps[3], 0xff, 0xe1]);
                    o.extend((sps.len() as u16).to_be_bytes().iter().chain(sps));
                    o.push(1);
                    o.extend((pps.len() as u16).to_be_bytes().iter().chain(pps));
                    if matches!(sps[1], 100 | 110 | 122 | 144) {
                        // High profiles also state 4:2:0 at 8 bits.
                        o.extend([0xfd, 0xf8, 0xf8, 0]);
                    }
                });
                // BT.601 (SMPTE 170M) primaries, transfer and matrix, limited range.
                bx(o, b"colr", |o| o.extend(b"nclx\0\x06\0\x06\0\x06\0"));
            });
        });
        bx(o, b"stts", |o| words(o, &[0, 1, count, MP4_TICKS]));
        bx(o, b"stss", |o| words(o, &stss));
        bx(o, b"stsc", |o| words(o, &[0, 1, 1, count, 1]));
        bx(o, b"stsz", |o| words(o, &stsz));
        bx(o, b"stco", |o| words(o, &[0, 1, chunk_offset]));
    }
}

/// Appends an ISO-BMFF box whose contents `body` writes; the size is patched in after.
fn bx(out: &mut Vec<u8>, kind: &[u8; 4], body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend([0, 0, 0, 0].iter().chain(kind));
    body(out);
    // Only mdat can outgrow 32 bits, and it is written by hand.
    let size = (out.len() - start) as u32;
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
}

fn words(out: &mut Vec<u8>, values: &[u32]) {
    out.extend(values.iter().flat_map(|v| v.to_be_bytes()));
}

// ---- GIF and WebP -------------------------------------------------------------------------

/// NeuQuant's sampling step: 10 is the gif crate's suggested balance of speed and palette.
const GIF_SPEED: i32 = 10;

fn gif(clip: &Clip) -> Result<Vec<u8>> {
    let side = |field: &str, n: usize| {
        u16::try_from(n).map_err(|_| Error::invalid(field, format!("{n} is over GIF's 65535")))
    };
    let (w, h) = (
        side("clip.width", clip.width)?,
        side("clip.height", clip.height)?,
    );
    let err = |e: gif::EncodingError| Error::internal("the GIF encoder failed", e);
    let mut encoder = gif::Encoder::new(Vec::new(), w, h, &[]).map_err(err)?;
    encoder.set_repeat(gif::Repeat::Infinite).map_err(err)?;
    for (i, rgb) in clip.frames.iter().enumerate() {
        let mut frame = gif::Frame::from_rgb_speed(w, h, rgb, GIF_SPEED);
        // Browsers play delays under 2 centiseconds at 10, far slower than asked.
        frame.delay = duration(i, clip.fps, 100.0).max(2.0) as u16;
        encoder.write_frame(&frame).map_err(err)?;
    }
    encoder.into_inner().map_err(err)
}

fn webp(clip: &Clip) -> Result<Vec<u8>> {
    let (w, h) = (clip.width, clip.height);
    if w > 16384 || h > 16384 {
        let msg = format!("{w}×{h} is over WebP's 16384×16384");
        return Err(Error::invalid("clip size", msg));
    }
    let err = |msg: String| Error::internal("the WebP encoder failed", msg);
    let mut canvas = (w as u32 - 1).to_le_bytes()[..3].to_vec();
    canvas.extend(&(h as u32 - 1).to_le_bytes()[..3]);
    let mut body = b"WEBP".to_vec();
    let vp8x = [&[2, 0, 0, 0][..], &canvas].concat(); // animated, no alpha or metadata
    riff_chunk(&mut body, b"VP8X", |o| o.extend(vp8x));
    // Background colour (a hint; the frames cover the canvas) and loop count 0, forever.
    riff_chunk(&mut body, b"ANIM", |o| o.extend([0, 0, 0, 0xff, 0, 0]));
    for (i, rgb) in clip.frames.iter().enumerate() {
        // The encoder writes a whole still file; its VP8L chunk is the frame's bitstream.
        let mut still = Vec::new();
        let encoder = WebPEncoder::new(&mut still);
        let done = encoder.encode(rgb, w as u32, h as u32, ColorType::Rgb8);
        done.map_err(|e| err(e.to_string()))?;
        let vp8l = match still.get(12..20) {
            Some([b'V', b'P', b'8', b'L', n @ ..]) => {
                still.get(20..20 + u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize)
            }
            _ => None,
        };
        let vp8l = vp8l.ok_or_else(|| err("image-webp wrote no VP8L chunk".into()))?;
        let millis = duration(i, clip.fps, 1000.0) as u32;
        riff_chunk(&mut body, b"ANMF", |o| {
            // At the canvas origin, covering it; replace it (no alpha blend), dispose nothing.
            o.extend([0; 6].iter().chain(&canvas));
            o.extend(&millis.to_le_bytes()[..3]);
            o.push(2);
            riff_chunk(o, b"VP8L", |o| o.extend(vp8l));
        });
    }
    let size = u32::try_from(body.len()).map_err(|_| err("file over 4 GiB".into()))?;
    Ok([&b"RIFF"[..], &size.to_le_bytes(), &body].concat())
}

/// Appends a RIFF chunk (little-endian size, padded to an even length).
fn riff_chunk(out: &mut Vec<u8>, kind: &[u8; 4], body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend(kind.iter().chain(&[0; 4]));
    body(out);
    let size = (out.len() - start - 8) as u32;
    out[start + 4..start + 8].copy_from_slice(&size.to_le_bytes());
    if size % 2 == 1 {
        out.push(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openh264::decoder::Decoder;
    use VideoFormat::{Gif, Mp4, Webp};

    const W: usize = 64;
    const H: usize = 48;

    /// Five frames of a gradient sliding right two pixels a frame under a still yellow bar.
    fn frames() -> Vec<Vec<u8>> {
        let pixel = |x: usize, y: usize, t: usize| match y {
            20..28 => [230, 230, 40],
            _ => [((x + 2 * t) * 3) as u8, (y * 5) as u8, 160 - (x + y) as u8],
        };
        let frame = |t| (0..W * H).flat_map(|i| pixel(i % W, i / W, t)).collect();
        (0..5).map(frame).collect()
    }

    fn clip(frames: &[Vec<u8>]) -> Clip<'_> {
        let (width, height, fps) = (W, H, 16.0);
        let frames = frames.iter().map(Vec::as_slice).collect();
        Clip {
            width,
            height,
            fps,
            frames,
        }
    }

    fn psnr(a: &[u8], b: &[u8]) -> f64 {
        let se = |(&x, &y): (&u8, &u8)| (f64::from(x) - f64::from(y)).powi(2);
        let mse = a.iter().zip(b).map(se).sum::<f64>() / a.len() as f64;
        10.0 * (255.0 * 255.0 / mse).log10()
    }

    /// A big-endian number.
    fn be(bytes: &[u8]) -> usize {
        bytes.iter().fold(0, |v, &b| v << 8 | usize::from(b))
    }

    /// The contents of the box reached by following `path` down from the boxes in `data`.
    fn find<'a>(mut data: &'a [u8], path: &[&[u8; 4]]) -> &'a [u8] {
        for kind in path {
            while &data[4..8] != *kind {
                data = &data[be(&data[..4])..];
            }
            data = &data[8..be(&data[..4])];
        }
        data
    }

    #[test]
    fn mp4_holds_every_frame_and_decodes_close_to_the_input() {
        let frames = frames();
        let file = encode(&clip(&frames), Mp4).unwrap();
        let moov = &file[be(&file[..4])..];
        assert_eq!([&file[4..8], &moov[4..8]], [b"ftyp", b"moov"]);
        let trak = find(&file, &[b"moov", b"trak"]);
        let stbl = find(trak, &[b"mdia", b"minf", b"stbl"]);
        let avc1 = find(&find(stbl, &[b"stsd"])[8..], &[b"avc1"]);
        assert_eq!([be(&avc1[24..26]), be(&avc1[26..28])], [W, H]);
        let mdhd = find(trak, &[b"mdia", b"mdhd"]);
        let (stts, stsz) = (find(stbl, &[b"stts"]), find(stbl, &[b"stsz"]));
        // Timescale, sample counts in time and size tables, ticks per sample.
        let fields = [&mdhd[12..16], &stts[8..12], &stsz[8..12], &stts[12..16]];
        assert_eq!(fields.map(be), [16_000, 5, 5, 1000]);

        // Back to Annex B for the decoder: parameter sets from avcC, then each sample with
        // its NAL lengths turned into start codes.
        let avcc = find(&avc1[78..], &[b"avcC"]);
        let sps = &avcc[8..][..be(&avcc[6..8])];
        let pps = &avcc[11 + sps.len()..][..be(&avcc[9 + sps.len()..][..2])];
        let mut stream = [&[0, 0, 0, 1], sps, &[0, 0, 0, 1], pps].concat();
        let mut at = be(&find(stbl, &[b"stco"])[8..12]);
        let mut decoder = Decoder::new().unwrap();
        for (i, input) in frames.iter().enumerate() {
            let end = at + be(&stsz[12 + 4 * i..][..4]);
            while at < end {
                let nal = &file[at + 4..][..be(&file[at..at + 4])];
                stream.extend([&[0, 0, 0, 1], nal].concat());
                at += 4 + nal.len();
            }
            let picture = decoder.decode(&stream).unwrap();
            let picture = picture.expect("a picture per sample");
            let mut rgb = vec![0; W * H * 3];
            picture.write_rgb8(&mut rgb);
            let db = psnr(input, &rgb);
            assert!(db > 35.0, "frame {i}: {db:.1} dB");
            stream.clear();
        }
        assert_eq!(at, file.len(), "mdat holds the samples and nothing else");
    }

    #[test]
    fn gif_loops_and_holds_every_frame_at_the_frame_rate() {
        let frames = frames();
        let file = encode(&clip(&frames), Gif).unwrap();
        let mut options = gif::DecodeOptions::new();
        options.set_color_output(gif::ColorOutput::RGBA);
        let mut decoder = options.read_info(file.as_slice()).unwrap();
        assert_eq!((decoder.width(), decoder.height()), (W as u16, H as u16));
        let mut delays = Vec::new();
        while let Some(frame) = decoder.read_next_frame().unwrap() {
            let rgba = frame.buffer.chunks(4);
            let rgb: Vec<u8> = rgba.flat_map(|p| &p[..3]).copied().collect();
            // One 256-colour palette cannot hold a gradient in three channels exactly.
            let db = psnr(&frames[delays.len()], &rgb);
            assert!(db > 25.0, "frame {}: {db:.1} dB", delays.len());
            delays.push(frame.delay);
        }
        // 6.25 centiseconds a frame, rounded on the running total.
        assert_eq!(delays, [6, 7, 6, 6, 6]);
        assert_eq!(decoder.repeat(), gif::Repeat::Infinite);
    }

    #[test]
    fn webp_is_an_exact_looping_animation() {
        let frames = frames();
        let file = encode(&clip(&frames), Webp).unwrap();
        let (mut kinds, mut at) = (Vec::new(), 12);
        while at < file.len() {
            kinds.push(&file[at..at + 4]);
            let size: [u8; 4] = file[at + 4..at + 8].try_into().unwrap();
            at += 8 + (u32::from_le_bytes(size) as usize).next_multiple_of(2);
        }
        let mut want = vec![&b"VP8X"[..], b"ANIM"];
        want.extend([&b"ANMF"[..]; 5]);
        assert_eq!(kinds, want);
        let mut decoder = image_webp::WebPDecoder::new(std::io::Cursor::new(&file)).unwrap();
        assert_eq!(decoder.dimensions(), (W as u32, H as u32));
        assert_eq!(decoder.loop_count(), image_webp::LoopCount::Forever);
        assert_eq!(decoder.num_frames(), 5);
        let mut rgb = vec![0; decoder.output_buffer_size().unwrap()];
        // 62.5 ms a frame, rounded on the running total.
        for (input, millis) in frames.iter().zip([63, 62, 63, 62, 63]) {
            assert_eq!(decoder.read_frame(&mut rgb).unwrap(), millis);
            assert!(&rgb == input, "frame differs");
        }
    }

    #[test]
    fn bad_clips_are_refused_naming_the_fault() {
        let frames = frames();
        let fault = |clip: &Clip, format| encode(clip, format).unwrap_err().to_string();
        let mut odd = clip(&frames);
        odd.width = W - 1;
        odd.frames = frames.iter().map(|f| &f[..(W - 1) * H * 3]).collect();
        assert!(fault(&odd, Mp4).contains("63×48"), "{}", fault(&odd, Mp4));
        assert!(encode(&odd, Gif).is_ok() && encode(&odd, Webp).is_ok());
        let mut short = clip(&frames);
        short.frames[1] = &frames[1][3..];
        assert!(fault(&short, Webp).contains("clip.frames[1]"));
        short.frames.clear();
        assert!(fault(&short, Mp4).contains("clip.frames"));
        for fps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let mut clip = clip(&frames);
            clip.fps = fps;
            assert!(fault(&clip, Gif).contains("clip.fps"));
        }
    }

    #[test]
    fn write_takes_the_format_from_the_extension_and_names_the_path_in_errors() {
        let of = |name: &str| VideoFormat::from_path(Path::new(name));
        let formats = ["a/b.MP4", "x.Gif", "x.webp", "x.mp4.png", "mp4", "x."].map(of);
        let want = [Some(Mp4), Some(Gif), Some(Webp), None, None, None];
        assert_eq!(formats, want);
        let (frames, dir) = (frames(), tempfile::tempdir().unwrap());
        let path = dir.path().join("clip.WebP");
        write(&path, &clip(&frames)).unwrap();
        let written = std::fs::read(&path).unwrap();
        assert_eq!(written, encode(&clip(&frames), Webp).unwrap());
        for name in ["clip.avi", "no/clip.gif"] {
            let path = dir.path().join(name);
            let err = write(&path, &clip(&frames)).unwrap_err().to_string();
            assert!(err.contains(&*path.to_string_lossy()), "{err}");
        }
    }
}
