//! Turns a decoded image into PNG bytes with the same pixel mapping diffusers uses
//! (`(x / 2 + 0.5).clamp(0, 1)`, then `round(x * 255)` half to even, as numpy rounds), so
//! a PNG from this engine and one from a diffusers pipeline agree pixel for pixel.

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

/// Encodes one image [3, H, W] with values in [-1, 1] (outside is clamped) as an RGB8 PNG.
pub fn encode_png(image: &Tensor) -> Result<Vec<u8>> {
    let dims = image.dims();
    let (height, width) = match *dims {
        [3, h, w] if h > 0 && w > 0 => (h, w),
        _ => {
            return Err(Error::invalid(
                "image",
                format!("expected [3, height, width] with both sides non-zero, found {dims:?}"),
            ))
        }
    };
    let too_big =
        |side: usize| Error::invalid("image", format!("side {side} is too large for a PNG"));
    let png_width = u32::try_from(width).map_err(|_| too_big(width))?;
    let png_height = u32::try_from(height).map_err(|_| too_big(height))?;

    // Channels last: PNG rows are interleaved RGB.
    let values: Vec<f32> = image
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .permute((1, 2, 0))?
        .flatten_all()?
        .to_vec1()?;
    let pixels: Vec<u8> = values.iter().map(|&v| to_u8(v)).collect();

    let mut bytes = Vec::new();
    let png_error = |e: png::EncodingError| Error::internal("the PNG encoder failed", e);
    let mut encoder = png::Encoder::new(&mut bytes, png_width, png_height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(png_error)?;
    writer.write_image_data(&pixels).map_err(png_error)?;
    writer.finish().map_err(png_error)?;
    Ok(bytes)
}

/// Writes one image [3, H, W] in [-1, 1] to `path` as a PNG.
pub fn write_png(path: &Path, image: &Tensor) -> Result<()> {
    let bytes = encode_png(image)?;
    std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
}

/// One channel value in [-1, 1] to a byte, the way diffusers' `numpy_to_pil` does it.
fn to_u8(v: f32) -> u8 {
    // NaN maps to 0 through the saturating cast, as it does in numpy's astype on x86.
    ((v / 2.0 + 0.5).clamp(0.0, 1.0) * 255.0).round_ties_even() as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> (png::OutputInfo, Vec<u8>) {
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        buf.truncate(info.buffer_size());
        (info, buf)
    }

    #[test]
    fn maps_values_like_diffusers() {
        assert_eq!(to_u8(-1.0), 0);
        assert_eq!(to_u8(1.0), 255);
        assert_eq!(to_u8(-7.0), 0);
        assert_eq!(to_u8(3.0), 255);
        assert_eq!(to_u8(0.0), 128); // 127.5 rounds half to even
        assert_eq!(to_u8(f32::NAN), 0);
    }

    #[test]
    fn png_round_trip_keeps_every_pixel() {
        let (h, w) = (5, 7);
        // Channel c, row y, column x gets a distinct value spread over [-1.2, 1.2].
        let values: Vec<f32> = (0..3 * h * w)
            .map(|i| (i as f32 / (3 * h * w - 1) as f32) * 2.4 - 1.2)
            .collect();
        let image = Tensor::from_vec(values.clone(), (3, h, w), &Device::Cpu).unwrap();
        let (info, pixels) = decode(&encode_png(&image).unwrap());
        assert_eq!((info.width, info.height), (w as u32, h as u32));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        for c in 0..3 {
            for y in 0..h {
                for x in 0..w {
                    let expected = to_u8(values[(c * h + y) * w + x]);
                    assert_eq!(pixels[(y * w + x) * 3 + c], expected, "c={c} y={y} x={x}");
                }
            }
        }
        assert_eq!(pixels[0], 0);
        assert_eq!(*pixels.last().unwrap(), 255);
    }

    #[test]
    fn write_png_writes_the_same_bytes() {
        let image = Tensor::zeros((3, 2, 2), DType::F32, &Device::Cpu).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.png");
        write_png(&path, &image).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), encode_png(&image).unwrap());
        let err = write_png(&dir.path().join("no/such/dir.png"), &image)
            .unwrap_err()
            .to_string();
        assert!(err.contains("dir.png"), "{err}");
    }

    #[test]
    fn rejects_other_shapes() {
        for shape in [&[1usize, 3, 4, 4][..], &[4, 4, 4], &[3, 0, 4]] {
            let t = Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
            let err = encode_png(&t).unwrap_err().to_string();
            assert!(err.contains("image"), "{err}");
        }
    }
}
